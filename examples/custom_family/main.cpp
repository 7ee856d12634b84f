// custom_family: difftrain's command line with one more model family, toy-dit (toy_family.h),
// registered by this program before difftrain's entry point runs. Every difftrain command works
// on toy-dit folders (train under launch, sample, lora convert / merge, forward, estimate-memory);
// the program's own command makes a fresh folder:
//   custom_family toy-init DIR [SEED]
//   custom_family launch -n 2 --cpu custom_family train --pretrained_model_name_or_path DIR ...
#include "toy_family.h"

#include "difftrain/cli/run.h"
#include "difftrain/core/exit.h"

#include <cstdlib>
#include <iostream>
#include <string>

int main(int argc, char** argv) {
  toy::register_toy_family();
  if (argc >= 3 && std::string(argv[1]) == "toy-init") {
    toy::write_initial_model(argv[2], toy::ToyConfig{},
                             argc >= 4 ? std::strtoull(argv[3], nullptr, 10) : 0);
    std::cout << "custom_family: wrote a toy-dit folder at " << argv[2] << "\n";
    return 0;
  }
  difftrain::exit_process(difftrain::cli::run_cli(argc, argv));
}
