#pragma once
// A checkpoint's manifest: `checksums.json` lists every file of a save_state() folder with its
// size and CRC32, so a resume can tell a damaged checkpoint (a truncated or bit-flipped file, a
// file gone missing) from a good one. Accelerate has no equivalent; it trusts the files.

#include <string>

namespace difftrain::accel {

/// File name of the manifest inside a checkpoint folder.
inline constexpr const char* kChecksumsFile = "checksums.json";

/// Writes `<dir>/checksums.json` (atomically): every regular file under `dir` except the
/// manifest itself, as {"path": relative path, "size": bytes, "crc32": zlib CRC32}. Called by
/// save_state() on the main rank once every rank has written its files, before the rename.
void write_checkpoint_manifest(const std::string& dir);

/// Checks every file `<dir>/checksums.json` lists: present, of the recorded size and CRC32.
/// Returns false when `dir` has no manifest (a checkpoint from before manifests; nothing is
/// checked) and true when every file matches. Throws difftrain::Error naming the first missing,
/// truncated or corrupted file, or an unreadable manifest.
bool verify_checkpoint(const std::string& dir);

}  // namespace difftrain::accel
