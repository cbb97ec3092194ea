// tools/cmd_model.hpp: the options and main of `megamoe model`, shared with `megamoe run`
// (which runs the example model when given no arguments).
#pragma once

#include "tools/cli.hpp"

namespace megamoe::cli {

// Declares `megamoe model`'s options on `app` and returns its main.
CommandMain setup_model_command(CLI::App& app);

}  // namespace megamoe::cli
