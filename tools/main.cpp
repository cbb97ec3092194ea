// megamoe: the command-line program. Subcommands live in tools/cmd_<name>.cpp and register
// themselves (tools/cli.hpp); this file only builds the parser and dispatches.
#include <algorithm>
#include <cstdio>
#include <exception>
#include <map>
#include <memory>
#include <string>

#include "megamoe/error.hpp"
#include "tools/cli.hpp"

namespace megamoe::cli {

namespace {
std::vector<CommandInfo>& registry() {
  static std::vector<CommandInfo> commands;
  return commands;
}
}  // namespace

Command::Command(std::string name, std::string description, CommandSetup setup) {
  registry().push_back({std::move(name), std::move(description), std::move(setup)});
}

std::vector<CommandInfo> registered_commands() {
  std::vector<CommandInfo> commands = registry();
  std::sort(commands.begin(), commands.end(),
            [](const CommandInfo& a, const CommandInfo& b) { return a.name < b.name; });
  return commands;
}

}  // namespace megamoe::cli

int main(int argc, char** argv) {
  using namespace megamoe;
  CLI::App app{"megamoe: MoE layers with MXFP4 expert weights and FP8 activations "
               "(CPU reference and Hopper kernels)",
               "megamoe"};
  app.set_version_flag("--version", "megamoe 0.1.0");
  app.require_subcommand(1);
  app.fallthrough(false);

  std::map<const CLI::App*, std::pair<std::string, cli::CommandMain>> mains;
  for (const auto& cmd : cli::registered_commands()) {
    CLI::App* sub = app.add_subcommand(cmd.name, cmd.description);
    mains[sub] = {cmd.name, cmd.setup(*sub)};
  }

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const Error& e) {
    std::fprintf(stderr, "megamoe: error (%s): %s\n", error_code_name(e.code()), e.what());
    return cli::kExitError;
  }

  for (const CLI::App* sub : app.get_subcommands()) {
    auto it = mains.find(sub);
    if (it == mains.end()) continue;
    const std::string& name = it->second.first;
    try {
      return it->second.second();
    } catch (const Error& e) {
      std::fprintf(stderr, "megamoe %s: error (%s): %s\n", name.c_str(), error_code_name(e.code()),
                   e.what());
      return cli::kExitError;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "megamoe %s: error: %s\n", name.c_str(), e.what());
      return cli::kExitError;
    }
  }
  std::fprintf(stderr, "megamoe: no subcommand given (see megamoe --help)\n");
  return cli::kExitError;
}
