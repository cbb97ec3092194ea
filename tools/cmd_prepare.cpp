// megamoe prepare CKPT --backend B --ep-rank r --ep-size R -o OUT: one EP rank's MoE layers,
// prepared for a backend's layout, in one safetensors file (format: prepare.hpp).
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "megamoe/checkpoint.hpp"
#include "megamoe/prepare.hpp"
#include "tools/cli.hpp"
#include "tools/progress.hpp"

namespace megamoe::cli {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

struct PrepareArgs {
  std::string path;
  std::string backend = "reference";
  int ep_rank = 0;
  int ep_size = 1;
  std::string out;
  std::vector<std::string> layers;
  int64_t scratch_mib = kDefaultPrepareScratchBytes / kMiB;
  int fused_sm = 0;
  bool quiet = false;
  bool allow_nan_scales = false;
};

double mib(int64_t bytes) { return static_cast<double>(bytes) / static_cast<double>(kMiB); }

int run_prepare(const PrepareArgs& args) {
  const Checkpoint ckpt = Checkpoint::open(args.path);
  PreparedCheckpointOptions opts;
  // --fused SM selects the fused MegaMoE layout of that GPU, whatever --backend says.
  opts.backend = args.fused_sm > 0 ? fused_layout_for_arch(args.fused_sm) : args.backend;
  opts.ep_rank = args.ep_rank;
  opts.ep_size = args.ep_size;
  opts.prefixes = args.layers;
  opts.prepare.scratch_bytes = args.scratch_mib * kMiB;
  opts.load.allow_nan_scales = args.allow_nan_scales;
  ProgressBar bar("prepare", !args.quiet);
  opts.progress = [&](int64_t done, int64_t total) { bar.update(done, total); };
  const PreparedCheckpointReport r = write_prepared_checkpoint(ckpt, args.out, opts);
  bar.finish();
  std::printf("wrote %s: %lld layer(s), layout '%s', EP rank %d of %d\n", args.out.c_str(),
              static_cast<long long>(r.layers), r.layout.c_str(), args.ep_rank, args.ep_size);
  std::printf("  bytes: %.2f MiB of prepared experts, %.2f MiB file, largest layer %.2f MiB\n",
              mib(r.weight_bytes), mib(r.file_bytes), mib(r.max_layer_bytes));
  std::printf("  memory: peak %.2f MiB held (one layer at a time), preparation scratch peak %.2f MiB\n",
              mib(r.peak_host_bytes), mib(r.peak_prepare_extra));
  std::printf("  time: %.2f s (%.1f MiB/s)\n", r.seconds,
              r.seconds > 0 ? mib(r.weight_bytes) / r.seconds : 0.0);
  return kExitOk;
}

const Command kPrepare{
    "prepare",
    "Write one EP rank's MoE layers prepared for a backend (reference, blackwell-interop, sm90)",
    [](CLI::App& app) -> CommandMain {
      auto args = std::make_shared<PrepareArgs>();
      app.add_option("checkpoint", args->path,
                     "a .safetensors file, a model.safetensors.index.json, or a folder")
          ->required();
      app.add_option("--backend", args->backend,
                     "reference (canonical), blackwell-interop, sm90, or any registered layout")
          ->capture_default_str();
      app.add_option("--fused", args->fused_sm,
                     "prepare for the fused MegaMoE kernel of this GPU (90 = Hopper, 100/103 = "
                     "Blackwell), overriding --backend");
      app.add_option("--ep-rank", args->ep_rank, "expert-parallel rank r")->capture_default_str();
      app.add_option("--ep-size", args->ep_size, "expert-parallel size R (must divide E)")
          ->capture_default_str();
      app.add_option("-o,--output", args->out, "output .safetensors file")->required();
      app.add_option("--layer", args->layers, "only the MoE layer with this prefix (repeatable)");
      app.add_option("--scratch-mib", args->scratch_mib,
                     "bound of the preparation scratch (at least one expert)")
          ->capture_default_str();
      app.add_flag("--quiet", args->quiet, "no progress bar");
      app.add_flag("--allow-nan-scales", args->allow_nan_scales,
                   "accept UE8M0 scale bytes 0xFF (NaN): the tokens of those experts become NaN");
      return [args] { return run_prepare(*args); };
    }};

}  // namespace
}  // namespace megamoe::cli
