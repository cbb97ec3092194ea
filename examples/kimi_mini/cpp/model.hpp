// model.hpp: an end-to-end model served by megamoe (examples/kimi_mini), and its gate. Built as
// the library megamoe_example_model, not part of libmegamoe.
//
//   auto model = KimiMiniModel::load("examples/kimi_mini");       // config.json + safetensors
//   auto problems = load_problems("examples/kimi_mini/heldout.jsonl");
//   EvalReport r = evaluate(model, problems);                       // greedy, batched, KV cache
//   r.accuracy >= kAccuracyGate                                     // the gate (issue 7)
//
// The model is a small decoder-only transformer whose MoE block follows Kimi-K3 (sigmoid router
// with a selection-only score-correction bias, routed experts on a latent width with SiTU and an
// RMSNorm after them, a BF16 SiTU shared expert); examples/kimi_mini/README.md describes it.
//
// Data flow of loading: Checkpoint::open -> find_moe_layers -> load_moe_layer (canonical
// MoeWeights) -> MoeLayer (prepares them for its backend). Dense tensors (embeddings, attention,
// norms, router, latent projections, shared expert, LM head) are BF16 in the checkpoint and
// computed in FP32 on the host with megamoe's thread pool; the routed experts run in MoeLayer on
// its backend ("cpu" = the contract reference, "sm90" = the Hopper kernels, inputs copied to the
// device and outputs back per layer call), or, with ModelOptions::ep_size = R, in R MoeLayers per
// layer, virtual ranks of one EP group on the GPU.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "megamoe/layer.hpp"
#include "megamoe/weights.hpp"

namespace megamoe::model {

constexpr double kAccuracyGate = 0.95;  // issue 7: 200 held-out problems, greedy decoding

// Hyper-parameters read from config.json (examples/kimi_mini/train.py writes it).
struct ModelConfig {
  int64_t vocab_size = 0;
  int64_t d_model = 0;
  int64_t n_layers = 0;
  int64_t n_heads = 0;
  int64_t max_seq_len = 0;
  double rope_theta = 0;
  double rms_norm_eps = 0;
  int64_t num_experts = 0;
  int64_t top_k = 0;
  int64_t latent_dim = 0;
  int64_t expert_intermediate = 0;
  int64_t shared_intermediate = 0;
  double routed_scaling_factor = 1.0;
  double situ_beta = 4.0;
  double situ_linear_beta = 25.0;
  std::string tensor_prefix;  // "language_model.model"

  int64_t head_dim() const { return d_model / n_heads; }
  void validate() const;  // kInvalidArgument / kFormat naming the field
};

// Character tokenizer: id 0 is padding, ids 1.. are single characters.
class Tokenizer {
 public:
  explicit Tokenizer(std::vector<std::string> vocab);
  // kInvalidArgument naming the character and its position when it is not in the vocabulary.
  std::vector<int32_t> encode(const std::string& text) const;
  std::string decode(const std::vector<int32_t>& ids) const;  // padding ids are skipped
  int32_t id_of(char c) const;                                // -1 when absent
  int64_t size() const { return static_cast<int64_t>(vocab_.size()); }

 private:
  std::vector<std::string> vocab_;
  int32_t char_to_id_[256];
};

struct ModelOptions {
  std::string backend = "auto";  // MoeLayer backend: "auto", "cpu", "sm90"
  bool fast_math = false;        // numerics.md section 4; exact by default (as trained)
  Precision precision = Precision::kExact;  // the MoE layers' GEMMs (docs/numerics.md "FP8 mode")
  int64_t fp8_min_rows_per_expert = LayerConfig{}.fp8_min_rows_per_expert;
  int64_t max_batch_tokens = 0;  // MoE capacity per call; 0 = max_seq_len * 256
  // Expert parallelism on one GPU: every MoE layer's experts spread over ep_size virtual ranks
  // (megamoe/ep.hpp; needs the sm90 backend, ep_size must divide num_experts). Each MoE call
  // splits its tokens into ep_size contiguous chunks, rank r taking chunk r (possibly empty) on
  // its own stream; the outputs are those of ep_size = 1.
  int ep_size = 1;
  // Called with (layer index, canonical weights) after loading and before the layer takes
  // them: lets a test corrupt weights in memory (the gate's sensitivity check). With
  // ep_size > 1 once per rank, with that rank's experts (first_expert says which).
  std::function<void(int64_t, MoeWeights&)> weights_hook;
};

// Routed-expert usage since loading or the last reset: tokens routed to (layer, expert).
struct ExpertUsage {
  int64_t num_layers = 0, num_experts = 0;
  std::vector<int64_t> counts;  // [layers, experts]
  int64_t at(int64_t layer, int64_t expert) const { return counts[layer * num_experts + expert]; }
};

class KimiMiniModel {
 public:
  // `path`: a folder with config.json and the checkpoint (model.safetensors, or shards with
  // model.safetensors.index.json). kIo / kFormat naming the file and tensor when anything is
  // missing or has the wrong dtype or shape.
  static KimiMiniModel load(const std::string& path, const ModelOptions& options = {});

  KimiMiniModel(KimiMiniModel&&) noexcept;
  KimiMiniModel& operator=(KimiMiniModel&&) noexcept;
  ~KimiMiniModel();

  const ModelConfig& config() const;
  const Tokenizer& tokenizer() const;
  const std::string& moe_backend() const;  // the backend the MoE layers run on
  int ep_size() const;                     // virtual EP ranks per MoE layer (1: none)
  const std::string& path() const;

  // Greedy decoding of every prompt in one batch with a KV cache: one prefill call over all
  // prompt tokens, then one decode step per generated token for the sequences still running.
  // A sequence stops at `stop` (not included in the result) or after max_new_tokens.
  std::vector<std::string> generate(const std::vector<std::string>& prompts,
                                    int64_t max_new_tokens, char stop = '\n');

  // Logits of the last position of each prompt (one prefill), [prompts, vocab] row-major.
  std::vector<float> last_logits(const std::vector<std::string>& prompts);

  const ExpertUsage& expert_usage() const;
  void reset_expert_usage();

 private:
  struct Impl;
  explicit KimiMiniModel(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// ---------------------------------------------------------------------------------------------
// The task (examples/kimi_mini/task.py) and the gate
// ---------------------------------------------------------------------------------------------
struct Problem {
  std::string question;
  std::string answer;  // reference reasoning, " 4*6=24. 23+24=47. #### 47"
  int64_t final = 0;
  std::string prompt() const { return "Q: " + question + "\nA:"; }
};

// One JSON object per line with "question", "answer", "final" (kFormat naming file and line).
std::vector<Problem> load_problems(const std::string& path);

// The integer after the last "####" in a generated answer.
std::optional<int64_t> final_answer(const std::string& generated);

constexpr int64_t kMaxNewTokens = 80;  // the longest reference answer is about 60 characters

struct EvalReport {
  int64_t total = 0;     // problems evaluated
  int64_t correct = 0;
  double accuracy = 0;   // correct / total
  std::vector<std::string> answers;  // generated text per problem (after "A:")
  std::vector<bool> is_correct;
  double seconds = 0;
  int64_t generated_tokens = 0;
  bool stopped_early = false;  // more than max_failures wrong: the rest was not run
};

struct EvalOptions {
  int64_t batch = 200;              // problems decoded together
  int64_t max_failures = -1;        // >= 0: stop once more problems than this are wrong
  std::function<void(int64_t, int64_t)> progress;  // (problems done, total)
};

EvalReport evaluate(KimiMiniModel& model, const std::vector<Problem>& problems,
                    const EvalOptions& options = {});

// Where the example model lives: $MEGAMOE_MODEL_DIR, else examples/kimi_mini under the current
// directory or under the source tree this program was built from. "" when none has a config.json.
std::string default_model_dir();

}  // namespace megamoe::model
