#pragma once

// The one place where difftrain's code differs between LibTorch generations: 1.13 (Debian 12)
// and 2.x (Debian 13's 2.6, pytorch.org's archives, pip `torch`). Everything else in the tree is
// written once against the API both share; a difference found later goes here, not into an #if
// at the call site.

#include <ATen/autocast_mode.h>
#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>
#include <torch/version.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <variant>

/// True when compiling against LibTorch major.minor or newer.
#define DIFFTRAIN_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||            \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

#if DIFFTRAIN_TORCH_AT_LEAST(2, 0)
#include <torch/csrc/distributed/c10d/Backend.hpp>
#endif
#if !DIFFTRAIN_TORCH_AT_LEAST(2, 1)
#include <c10/util/variant.h>  // c10::get_if (LibTorch < 2.1)
#endif

namespace difftrain::compat {

/// The LibTorch generation difftrain was compiled against, e.g. 113 for 1.13 and 206 for 2.6.
inline constexpr int kTorchVersion = TORCH_VERSION_MAJOR * 100 + TORCH_VERSION_MINOR;

// ------------------------------------------------------------------ c10d
// LibTorch 2.0 split c10d's ProcessGroup into a front (ProcessGroup) and per-device backends
// (c10d::Backend): ProcessGroupGloo and ProcessGroupNCCL derive from Backend there, from
// ProcessGroup in 1.13. Both bases carry the same collective methods (allreduce, broadcast,
// allgather, _allgather_base, _reduce_scatter_base, alltoall_base, barrier), so difftrain holds
// the backend through this one type and calls them directly.
#if DIFFTRAIN_TORCH_AT_LEAST(2, 0)
using C10dBackend = c10d::Backend;
#else
using C10dBackend = c10d::ProcessGroup;
#endif

/// Selects TCPStore's classic (one-thread) server, which every LibTorch has. LibTorch 2.4 made
/// the libuv server the default (TCPStoreOptions::useLibUV, 2.2+), and a LibTorch built without
/// libuv (Debian 13's) then refuses to open a store at all. `options` is a c10d::TCPStoreOptions;
/// where it has no useLibUV field (1.13) this does nothing.
template <typename TCPStoreOptions>
auto use_classic_tcpstore(TCPStoreOptions& options, int = 0)
    -> decltype(options.useLibUV = false, void()) {
  options.useLibUV = false;
}
template <typename TCPStoreOptions>
void use_classic_tcpstore(TCPStoreOptions&, long = 0) {}

// ------------------------------------------------------------------ autocast
// LibTorch 2.4 replaced the per-device autocast switches (is_enabled / is_cpu_enabled,
// get_autocast_gpu_dtype / get_autocast_cpu_dtype, ...) by one family taking the device type,
// and deprecated the old names. Only CPU and CUDA are used here.

/// torch.is_autocast_enabled(device_type).
inline bool autocast_enabled(c10::DeviceType device) {
#if DIFFTRAIN_TORCH_AT_LEAST(2, 4)
  return at::autocast::is_autocast_enabled(device);
#else
  return device == c10::DeviceType::CUDA ? at::autocast::is_enabled()
                                         : at::autocast::is_cpu_enabled();
#endif
}

/// torch.set_autocast_enabled(device_type, enabled).
inline void set_autocast_enabled(c10::DeviceType device, bool enabled) {
#if DIFFTRAIN_TORCH_AT_LEAST(2, 4)
  at::autocast::set_autocast_enabled(device, enabled);
#else
  if (device == c10::DeviceType::CUDA) {
    at::autocast::set_enabled(enabled);
  } else {
    at::autocast::set_cpu_enabled(enabled);
  }
#endif
}

/// torch.get_autocast_dtype(device_type).
inline c10::ScalarType autocast_dtype(c10::DeviceType device) {
#if DIFFTRAIN_TORCH_AT_LEAST(2, 4)
  return at::autocast::get_autocast_dtype(device);
#else
  return device == c10::DeviceType::CUDA ? at::autocast::get_autocast_gpu_dtype()
                                         : at::autocast::get_autocast_cpu_dtype();
#endif
}

/// torch.set_autocast_dtype(device_type, dtype).
inline void set_autocast_dtype(c10::DeviceType device, c10::ScalarType dtype) {
#if DIFFTRAIN_TORCH_AT_LEAST(2, 4)
  at::autocast::set_autocast_dtype(device, dtype);
#else
  if (device == c10::DeviceType::CUDA) {
    at::autocast::set_autocast_gpu_dtype(dtype);
  } else {
    at::autocast::set_autocast_cpu_dtype(dtype);
  }
#endif
}

/// The autocast switches of one device type, as a backward that recomputes part of its forward
/// needs them (backward runs outside the caller's autocast region; torch.utils.checkpoint does
/// the same).
struct AutocastState {
  bool enabled = false;
  c10::ScalarType dtype = c10::ScalarType::BFloat16;
};

inline AutocastState autocast_state(c10::DeviceType device) {
  return {autocast_enabled(device), autocast_dtype(device)};
}

/// Sets one device type's autocast to `state` for its lifetime, then back.
class AutocastRestore {
 public:
  AutocastRestore(c10::DeviceType device, AutocastState state)
      : device_(device), outer_(autocast_state(device)) {
    set_autocast_enabled(device_, state.enabled);
    set_autocast_dtype(device_, state.dtype);
  }
  ~AutocastRestore() {
    set_autocast_enabled(device_, outer_.enabled);
    set_autocast_dtype(device_, outer_.dtype);
  }
  AutocastRestore(const AutocastRestore&) = delete;
  AutocastRestore& operator=(const AutocastRestore&) = delete;

 private:
  c10::DeviceType device_;
  AutocastState outer_;
};

// ------------------------------------------------------------------ variants
// c10::variant (Conv2dOptions::padding_t, ...) became std::variant in LibTorch 2.1, and
// c10::get_if went with it.

/// std::get_if / c10::get_if on a LibTorch variant: a pointer to the T alternative, or nullptr.
template <typename T, typename Variant>
auto variant_get_if(Variant* variant) {
#if DIFFTRAIN_TORCH_AT_LEAST(2, 1)
  return std::get_if<T>(variant);
#else
  return c10::get_if<T>(variant);
#endif
}

}  // namespace difftrain::compat
