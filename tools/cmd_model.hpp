// tools/cmd_model.hpp: the options and main of `megamoe model`, shared with `megamoe run`
// (which runs the example model when given no arguments).
#pragma once

#include "tools/cli.hpp"

namespace megamoe::cli {

// Declares `megamoe model`'s options on `app` and returns its main.
CommandMain setup_model_command(CLI::App& app);

// `megamoe model` with every option at its default: examples/kimi_mini on the best backend, the
// 200 held-out problems, three of them printed with their answers, then the accuracy and the
// gate. Returns the exit code (kExitCheckFailed when the gate fails).
int run_default_model();

}  // namespace megamoe::cli
