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

#include "megamoe/config.hpp"

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

// The Hopper backend's options as flags (`run`, `bench`): --tile, --no-pdl, --mega,
// --mega-dispatch, --mega-combine, --no-decode-front, --rows-hint, mapped onto LayerConfig::sm90 (validated with
// the config).
struct Sm90Flags {
  std::string tile = "auto";
  bool no_pdl = false;
  bool mega = false;
  bool mega_dispatch = false;
  bool mega_combine = false;
  bool no_decode_front = false;
  std::string rows_hint = "gated";

  void add_to(CLI::App& app) {
    app.add_option("--tile", tile,
                   "GEMM tile: auto (the policy), serial (the policy over the serial-mainloop "
                   "tiles) or a tile name (megamoe bench --list-tiles; an fp8_* tile with "
                   "--precision fp8 applies to the FP8 calls)")
        ->capture_default_str();
    app.add_flag("--no-pdl", no_pdl, "plain launches instead of programmatic dependent launch");
    app.add_flag("--mega", mega,
                 "the MegaMoE kernel: both expert GEMMs in one persistent launch for calls with "
                 "8 or more estimated rows and up to 12 rows per expert, and prefill calls on "
                 "the staged 256 x 128 tiles (exact mode; a forced tile it is built for runs "
                 "fused, also the FP8 tiles fp8_128x192_k2_async and fp8_256x128_k2_staged); the "
                 "chain otherwise");
    app.add_flag("--mega-dispatch", mega_dispatch,
                 "with --mega under expert parallelism: the MegaMoE kernel gathers each received "
                 "token row as it arrives (the dispatch inside the launch) instead of a gather "
                 "launch after every rank's rows");
    app.add_flag("--mega-combine", mega_combine,
                 "with --mega: the MegaMoE kernel also sums y (and under expert parallelism "
                 "returns its rows' signal) for calls of up to 16384 items (T * H / 8) instead "
                 "of the combine (and return) launches after it");
    app.add_flag("--no-decode-front", no_decode_front,
                 "quantize, dispatch and gather as three launches also for decode calls "
                 "(T*K <= 1024 on one GPU, exact mode), where they are one by default");
    app.add_option("--rows-hint", rows_hint,
                   "how the tile policy estimates a launch's rows: gated | bound | expected")
        ->capture_default_str();
  }
  void apply(LayerConfig& config) const {
    config.sm90.gemm_tile = tile;
    config.sm90.programmatic_launch = !no_pdl;
    config.sm90.mega_kernel = mega;
    config.sm90.mega_dispatch = mega_dispatch;
    config.sm90.mega_combine = mega_combine;
    config.sm90.decode_front = !no_decode_front;
    config.sm90.rows_hint = parse_rows_hint_mode(rows_hint);
  }
};

// --precision and --fp8-min-rows (run, model, bench): the expert GEMMs' precision and the FP8
// mode's per-call rule (LayerConfig::precision, fp8_min_rows_per_expert; docs/numerics.md).
struct PrecisionFlags {
  std::string precision = "exact";
  int64_t fp8_min_rows = LayerConfig{}.fp8_min_rows_per_expert;

  void add_to(CLI::App& app) {
    app.add_option("--precision", precision,
                   "Expert GEMMs: exact (the contract) or fp8 (the FP8 mode of docs/numerics.md, "
                   "on both backends; sm90: H and I multiples of 128)")
        ->check(CLI::IsMember({"exact", "fp8"}))
        ->capture_default_str();
    app.add_option("--fp8-min-rows", fp8_min_rows,
                   "With --precision fp8: the FP8 mode for calls with at least this many routed "
                   "rows per expert on average (T*K/E), the exact mode below; 0 = every call")
        ->check(CLI::NonNegativeNumber)
        ->capture_default_str();
  }
  // Sets `precision` and `fp8_min_rows_per_expert` of a LayerConfig or the model's options.
  template <class Options>
  void apply(Options& options) const {
    options.precision = parse_precision(precision);
    options.fp8_min_rows_per_expert = fp8_min_rows;
  }
};

// Exit codes shared by the commands.
constexpr int kExitOk = 0;
constexpr int kExitError = 1;         // a megamoe::Error or other failure while running
constexpr int kExitCheckFailed = 3;   // ran, but a requested check (e.g. a tolerance) failed

}  // namespace megamoe::cli
