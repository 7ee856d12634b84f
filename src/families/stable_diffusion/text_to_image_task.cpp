// make_text_to_image_task: the Stable-Diffusion text-to-image task (text_to_image_task.h).
#include "text_to_image_task.h"

namespace difftrain::train {

std::unique_ptr<TrainingTask> make_text_to_image_task(TaskOptions options) {
  return std::make_unique<t2i::TextToImageTask>(std::move(options));
}

}  // namespace difftrain::train
