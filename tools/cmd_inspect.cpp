// megamoe inspect CKPT: MoE layers, experts, shapes, dtypes and scale-exponent statistics.
#include <cstdio>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "megamoe/checkpoint.hpp"
#include "megamoe/prepare.hpp"
#include "tools/cli.hpp"
#include "tools/progress.hpp"

namespace megamoe::cli {
namespace {

struct InspectArgs {
  std::string path;
  bool no_stats = false;
  bool json = false;
  bool list_tensors = false;
  bool per_expert = false;
};

nlohmann::json stats_json(const ScaleStats& s) {
  nlohmann::json hist = nlohmann::json::object();
  for (int i = 0; i < kNumUe8m0Codes; ++i)
    if (s.spread_rows[i] > 0) hist[std::to_string(i)] = s.spread_rows[i];
  return {{"rows", s.rows},
          {"values", s.values},
          {"nan_values", s.nan_values},
          {"min_byte", s.min <= s.max ? s.min : -1},
          {"max_byte", s.max},
          {"row_spread_p50", s.spread_percentile(0.5)},
          {"row_spread_p99", s.spread_percentile(0.99)},
          {"row_spread_max", s.max_spread()},
          {"rows_within_fold_range", s.fraction_rows_within(kMaxExactFoldSpread)},
          {"fold_exact", s.fold_exact()},
          {"row_spread_histogram", hist}};
}

// A file written by `megamoe prepare`: its layout, rank and layers (no expert tensors to parse).
void print_prepared(const Checkpoint& ckpt) {
  if (ckpt.files().size() != 1) return;
  const SafetensorsFile& f = ckpt.files().front();
  const auto& meta = f.metadata();
  const auto fmt = meta.find("megamoe.format");
  if (fmt == meta.end() || fmt->second != kPreparedFormat) return;
  auto get = [&](const char* key) {
    const auto it = meta.find(key);
    return it == meta.end() ? std::string("?") : it->second;
  };
  std::printf("prepared checkpoint (%s): layout '%s', backend '%s', EP rank %s of %s, from %s\n",
              kPreparedFormat, get("megamoe.layout").c_str(), get("megamoe.backend").c_str(),
              get("megamoe.ep_rank").c_str(), get("megamoe.ep_size").c_str(),
              get("megamoe.source").c_str());
  for (const std::string& prefix : prepared_layer_prefixes(f)) {
    const MoeWeights w = load_prepared_layer(f, prefix, /*allow_nan_scales=*/true);  // described, not used
    std::printf("  %s: E_l = %lld (experts %lld..%lld), H = %lld, I = %lld, bias %s\n", prefix.c_str(),
                static_cast<long long>(w.num_local_experts), static_cast<long long>(w.first_expert),
                static_cast<long long>(w.first_expert + w.num_local_experts - 1),
                static_cast<long long>(w.hidden), static_cast<long long>(w.intermediate),
                w.has_bias() ? "yes" : "no");
  }
}

int run_inspect(const InspectArgs& args) {
  const Checkpoint ckpt = Checkpoint::open(args.path);
  print_prepared(ckpt);
  if (args.list_tensors) {
    ckpt.for_each([](const std::string& name, const Checkpoint::TensorRef& ref) {
      std::printf("%s  %s\n", name.c_str(), ref.info->describe().c_str());
    });
  }
  InspectOptions opts;
  opts.scale_stats = !args.no_stats;
  ProgressBar bar("inspect");
  opts.progress = [&](int64_t done, int64_t total) { bar.update(done, total); };
  const std::vector<InspectLayer> layers = inspect_checkpoint(ckpt, opts);
  bar.finish();
  if (!args.json) {
    std::fputs(format_inspect_report(ckpt, layers, args.per_expert).c_str(), stdout);
    return kExitOk;
  }
  nlohmann::json out = {{"path", ckpt.path()},
                        {"files", ckpt.files().size()},
                        {"tensors", ckpt.num_tensors()},
                        {"bytes", ckpt.total_bytes()},
                        {"max_exact_fold_spread", kMaxExactFoldSpread},
                        {"layers", nlohmann::json::array()}};
  for (const InspectLayer& l : layers) {
    nlohmann::json jl = {{"prefix", l.info.prefix},
                         {"layer_index", l.info.layer_index},
                         {"convention", expert_convention_name(l.info.convention)},
                         {"num_experts", l.info.num_experts},
                         {"hidden", l.info.hidden},
                         {"intermediate", l.info.intermediate},
                         {"bias", l.info.has_bias},
                         {"expert_bytes", l.expert_bytes},
                         {"matrices", nlohmann::json::array()}};
    for (const InspectMatrix& m : l.matrices) {
      nlohmann::json jm = {{"role", m.role}, {"weight", m.weight_desc}, {"scale", m.scale_desc}};
      if (m.stats.rows > 0) {
        jm["scale_stats"] = stats_json(m.stats);
        jm["sm90_gemm_path"] = m.first_serial.found() ? "serial" : "fast";
        if (m.first_serial.found())
          jm["sm90_serial_reason"] = {{"expert", m.first_serial.expert},
                                      {"scale_byte", m.first_serial.byte}};
        if (m.first_nan.found()) jm["first_nan_scale_expert"] = m.first_nan.expert;
      }
      if (args.per_expert) {
        nlohmann::json pe = nlohmann::json::array();
        for (const ExpertScaleSummary& x : m.per_expert)
          pe.push_back({{"min_byte", x.min <= x.max ? x.min : -1}, {"max_byte", x.max},
                        {"max_row_spread", x.max_row_spread}});
        jm["per_expert"] = std::move(pe);
      }
      jl["matrices"].push_back(std::move(jm));
    }
    out["layers"].push_back(std::move(jl));
  }
  std::printf("%s\n", out.dump(2).c_str());
  return kExitOk;
}

const Command kInspect{
    "inspect",
    "Describe a checkpoint's MoE layers: experts, shapes, dtypes, scale-exponent statistics",
    [](CLI::App& app) -> CommandMain {
      auto args = std::make_shared<InspectArgs>();
      app.add_option("checkpoint", args->path,
                     "a .safetensors file, a model.safetensors.index.json, or a folder")
          ->required();
      app.add_flag("--no-stats", args->no_stats, "shapes only: do not read the scale tensors");
      app.add_flag("--json", args->json, "print a JSON document instead of the text report");
      app.add_flag("--list-tensors", args->list_tensors, "also list every tensor with dtype and shape");
      app.add_flag("--per-expert", args->per_expert,
                   "scale statistics of every expert's tensor (min, max, largest row spread)");
      return [args] { return run_inspect(*args); };
    }};

}  // namespace
}  // namespace megamoe::cli
