// tools/cli.hpp: how a subcommand of the `megamoe` program plugs in.
//
// Each tools/cmd_<name>.cpp defines one registration object at namespace scope:
//
//   static const megamoe::cli::Command kInspect{
//       "inspect", "Describe a checkpoint's MoE layers",
//       [](CLI::App& app) -> megamoe::cli::CommandMain {
//         auto opts = std::make_shared<Options>();
//         app.add_option("path", opts->path, "checkpoint folder")->required();
//         return [opts] { return run_inspect(*opts); };   // exit code
//       }};
//
// NOTES: the command files are compiled straight into the executable (CMake globs tools/*.cpp
// into megamoe_cli), not into a static library, so the linker keeps every registration object
// and main.cpp never needs editing. main.cpp lists the commands sorted by name, parses, and runs
// the chosen one; a megamoe::Error escaping a command is printed with its code (exit 1).
#pragma once

#include <CLI/CLI.hpp>

#include <functional>
#include <string>
#include <vector>

namespace megamoe::cli {

// Runs a parsed command; returns the process exit code.
using CommandMain = std::function<int()>;
// Declares a command's options and positionals on `app` (its CLI11 subcommand) and returns the
// function to run when the command is chosen. Option storage must outlive the call (capture a
// shared_ptr in the returned function).
using CommandSetup = std::function<CommandMain(CLI::App& app)>;

struct CommandInfo {
  std::string name;
  std::string description;
  CommandSetup setup;
};

// Registers a subcommand at static-initialisation time.
class Command {
 public:
  Command(std::string name, std::string description, CommandSetup setup);
};

// All registered commands, sorted by name.
std::vector<CommandInfo> registered_commands();

// Exit codes shared by the commands.
constexpr int kExitOk = 0;
constexpr int kExitError = 1;         // a megamoe::Error or other failure while running
constexpr int kExitCheckFailed = 3;   // ran, but a requested check (e.g. a tolerance) failed

}  // namespace megamoe::cli
