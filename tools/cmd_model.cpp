// `megamoe model`: the end-to-end example model (examples/kimi_mini) served by megamoe.
//
// Loads the checkpoint through the normal path (checkpoint reader -> canonical MoE weights ->
// MoeLayer on the chosen backend), warms up, greedy-decodes held-out problems in one batch with
// a KV cache, prints a few problems with their answers, and reports the accuracy against the
// gate (model.hpp kAccuracyGate). Exit code kExitCheckFailed when the gate fails. With
// --ep-size R each MoE layer's experts are spread over R virtual EP ranks on the GPU
// (ModelOptions::ep_size); the answers are those of R = 1.
#include <chrono>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "examples/kimi_mini/cpp/model.hpp"
#include "megamoe/error.hpp"
#include "megamoe/parallel.hpp"
#include "tools/cli.hpp"
#include "tools/cmd_model.hpp"

namespace megamoe::cli {
namespace {

constexpr int64_t kWarmupPrompts = 2;
constexpr int64_t kWarmupNewTokens = 4;

struct ModelCmdOptions {
  std::string model_dir;     // "" = model::default_model_dir()
  std::string problems;      // "" = <model_dir>/heldout.jsonl
  std::string backend = "auto";
  int64_t limit = 0;         // 0 = all problems
  int64_t batch = 200;
  int64_t show = 3;
  int threads = 0;
  bool fast_math = false;
  PrecisionFlags precision;
  int ep_size = 1;
  double gate = model::kAccuracyGate;
  bool json = false;
};

int run_model(const ModelCmdOptions& o) {
  const auto t0 = std::chrono::steady_clock::now();
  if (o.threads > 0) set_num_threads(o.threads);
  const std::string dir = o.model_dir.empty() ? model::default_model_dir() : o.model_dir;
  MEGAMOE_CHECK(!dir.empty(), ErrorCode::kIo,
                "megamoe model: no model folder found (looked for examples/kimi_mini/config.json "
                "under the current directory and the source tree); pass --model DIR");
  const std::string problems_path = o.problems.empty() ? dir + "/heldout.jsonl" : o.problems;
  MEGAMOE_CHECK_ARG(o.batch > 0, "--batch must be > 0, got ", o.batch);
  MEGAMOE_CHECK_ARG(o.limit >= 0, "--limit must be >= 0, got ", o.limit);
  MEGAMOE_CHECK_ARG(o.gate >= 0 && o.gate <= 1, "--gate must be in [0, 1], got ", o.gate);

  model::ModelOptions mo;
  mo.backend = o.backend;
  mo.fast_math = o.fast_math;
  o.precision.apply(mo);
  mo.ep_size = o.ep_size;
  model::KimiMiniModel m = model::KimiMiniModel::load(dir, mo);
  const double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::vector<model::Problem> problems = model::load_problems(problems_path);
  if (o.limit > 0 && o.limit < static_cast<int64_t>(problems.size())) problems.resize(o.limit);

  // warm-up: a short decode on two prompts (first-touch of weights, backend setup)
  const auto tw = std::chrono::steady_clock::now();
  std::vector<std::string> warm;
  for (int64_t i = 0; i < std::min<int64_t>(kWarmupPrompts, problems.size()); ++i)
    warm.push_back(problems[i].prompt());
  m.generate(warm, kWarmupNewTokens);
  m.reset_expert_usage();
  const double warm_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - tw).count();

  model::EvalOptions eo;
  eo.batch = o.batch;
  const model::EvalReport r = model::evaluate(m, problems, eo);
  const bool pass = r.accuracy >= o.gate;
  const auto& c = m.config();

  if (o.json) {
    nlohmann::json j;
    j["model"] = dir;
    j["problems"] = problems_path;
    j["backend"] = m.moe_backend();
    j["threads"] = num_threads();
    j["fast_math"] = o.fast_math;
    j["precision"] = o.precision.precision;
    j["ep_size"] = m.ep_size();
    j["config"] = {{"d_model", c.d_model}, {"layers", c.n_layers}, {"experts", c.num_experts},
                   {"top_k", c.top_k}, {"latent", c.latent_dim},
                   {"expert_intermediate", c.expert_intermediate}};
    j["total"] = r.total;
    j["correct"] = r.correct;
    j["accuracy"] = r.accuracy;
    j["gate"] = o.gate;
    j["pass"] = pass;
    j["answers"] = r.answers;
    j["seconds"] = {{"load", load_s}, {"warmup", warm_s}, {"eval", r.seconds}};
    j["generated_tokens"] = r.generated_tokens;
    std::printf("%s\n", j.dump(1).c_str());
  } else {
    std::printf("megamoe model: %s\n", dir.c_str());
    const std::string ep =
        m.ep_size() > 1 ? " over " + std::to_string(m.ep_size()) + " virtual EP ranks" : "";
    std::printf("  model     d_model %lld, %lld layers, MoE E=%lld top-%lld on latent %lld, "
                "I=%lld, SiTU; routed experts MXFP4 on backend %s%s, fast_math %s, precision %s, "
                "%d host threads\n",
                static_cast<long long>(c.d_model), static_cast<long long>(c.n_layers),
                static_cast<long long>(c.num_experts), static_cast<long long>(c.top_k),
                static_cast<long long>(c.latent_dim), static_cast<long long>(c.expert_intermediate),
                m.moe_backend().c_str(), ep.c_str(), o.fast_math ? "on" : "off (exact)",
                o.precision.precision.c_str(), num_threads());
    std::printf("  loaded    in %.2f s, warm-up %.2f s\n", load_s, warm_s);
    for (int64_t i = 0; i < std::min<int64_t>(o.show, r.total); ++i) {
      const auto& p = problems[static_cast<size_t>(i)];
      std::printf("\n  Q: %s\n  A:%s\n     %s (expected %lld)\n", p.question.c_str(),
                  r.answers[i].c_str(), r.is_correct[i] ? "correct" : "WRONG",
                  static_cast<long long>(p.final));
    }
    std::printf("\n  accuracy  %lld / %lld = %.3f on %s (greedy, batch %lld), gate %.2f: %s\n",
                static_cast<long long>(r.correct), static_cast<long long>(r.total), r.accuracy,
                problems_path.c_str(), static_cast<long long>(o.batch), o.gate,
                pass ? "PASS" : "FAIL");
    std::printf("  time      %.2f s for %lld generated tokens (%.0f tokens/s)\n", r.seconds,
                static_cast<long long>(r.generated_tokens),
                r.seconds > 0 ? static_cast<double>(r.generated_tokens) / r.seconds : 0.0);
  }
  return pass ? kExitOk : kExitCheckFailed;
}

}  // namespace

int run_default_model() { return run_model(ModelCmdOptions{}); }

CommandMain setup_model_command(CLI::App& app) {
  auto o = std::make_shared<ModelCmdOptions>();
  app.add_option("--model", o->model_dir,
                 "Model folder (config.json + model.safetensors); default examples/kimi_mini");
  app.add_option("--problems", o->problems, "Problems (JSON lines); default <model>/heldout.jsonl");
  app.add_option("--backend", o->backend, "MoE backend: auto, cpu, sm90")->capture_default_str();
  app.add_option("--limit", o->limit, "Evaluate only the first N problems (0 = all)");
  app.add_option("--batch", o->batch, "Problems decoded together")->capture_default_str();
  app.add_option("--show", o->show, "Problems printed with their answers")->capture_default_str();
  app.add_option("--threads", o->threads, "Host threads (0 = all cores)");
  app.add_flag("--fast-math", o->fast_math,
               "fast_math on (the layer default: approximate exp/rcp in the expert activation); "
               "default off, as the model was trained");
  o->precision.add_to(app);
  app.add_option("--ep-size", o->ep_size,
                 "Spread each MoE layer's experts over R virtual EP ranks on the GPU (sm90 "
                 "backend; R must divide the model's experts); each call's tokens are split into "
                 "R chunks, one per rank. The answers equal R = 1's")
      ->capture_default_str();
  app.add_option("--gate", o->gate, "Accuracy the run must reach")->capture_default_str();
  app.add_flag("--json", o->json, "Print one JSON object");
  return [o] { return run_model(*o); };
}

namespace {
const Command kModel{
    "model",
    "Run the example Kimi-K3-style model (examples/kimi_mini) on held-out problems: accuracy gate",
    [](CLI::App& app) -> CommandMain { return setup_model_command(app); }};
}  // namespace

}  // namespace megamoe::cli
