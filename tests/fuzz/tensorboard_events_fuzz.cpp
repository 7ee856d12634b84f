// Fuzzes the TensorBoard event-file reader: accel::parse_tfrecords (length, CRCs) and
// parse_tensorboard_event (the Event / Summary / Image protobuf fields). The fuzzer rarely gets a
// CRC right, so the input is also decoded as one record directly.
#include "difftrain/accel/tensorboard_events.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  difftrain::fuzz::init_torch();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return difftrain::fuzz::run_one(data, size, [](std::string_view bytes) {
    try {
      (void)difftrain::accel::parse_tensorboard_event(bytes, "fuzz.event");
    } catch (const difftrain::Error&) {
    }
    for (const auto& record : difftrain::accel::parse_tfrecords(bytes, "fuzz.tfevents")) {
      (void)difftrain::accel::parse_tensorboard_event(record, "fuzz.tfevents");
    }
  });
}
