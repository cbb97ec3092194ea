// The kimi_mini model (examples/kimi_mini): loading, the batched forward with a KV cache, and
// greedy decoding. The routed experts of every layer run in a megamoe::MoeLayer (or in one per
// rank of a virtual EP group: ModelOptions::ep_size); everything else is FP32 on the host
// (dense_ops.hpp).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "examples/kimi_mini/cpp/dense_ops.hpp"
#include "examples/kimi_mini/cpp/model.hpp"
#include "megamoe/checkpoint.hpp"
#include "megamoe/ep.hpp"
#include "megamoe/error.hpp"
#include "megamoe/formats.hpp"
#include "megamoe/layer.hpp"
#include "megamoe/parallel.hpp"
#include "megamoe/routing.hpp"

#if defined(MEGAMOE_WITH_CUDA)
#include <cuda_runtime.h>
#endif

namespace megamoe::model {

namespace fs = std::filesystem;

namespace {

constexpr const char* kConfigFile = "config.json";
constexpr const char* kSingleFileCheckpoint = "model.safetensors";
constexpr int64_t kDefaultCapacityTokens = 64 * 1024;  // MoE tokens per call (prefill chunks)
// RoPE table length: prompts of the task are < 400 characters; decoding adds kMaxNewTokens.
constexpr int64_t kRopePositions = 4096;

// ---------------------------------------------------------------------------------------------
// Config
// ---------------------------------------------------------------------------------------------
template <typename T>
T json_field(const nlohmann::json& j, const char* key, const std::string& file) {
  MEGAMOE_CHECK(j.contains(key), ErrorCode::kFormat, file, ": missing field '", key, "'");
  try {
    return j.at(key).get<T>();
  } catch (const nlohmann::json::exception& e) {
    fail(ErrorCode::kFormat, file, ": field '", key, "' has the wrong type (", e.what(), ")");
  }
}

nlohmann::json read_json(const std::string& path) {
  std::ifstream f(path);
  MEGAMOE_CHECK(f.good(), ErrorCode::kIo, path, ": cannot open");
  try {
    return nlohmann::json::parse(f);
  } catch (const nlohmann::json::exception& e) {
    fail(ErrorCode::kFormat, path, ": not valid JSON (", e.what(), ")");
  }
}

// ---------------------------------------------------------------------------------------------
// Dense tensors: BF16 (FP32 for the router bias) in the checkpoint, FP32 in memory
// ---------------------------------------------------------------------------------------------
std::string shape_str(const std::vector<int64_t>& s) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << "]";
  return os.str();
}

std::vector<float> load_dense(const Checkpoint& ck, const std::string& name,
                              const std::vector<int64_t>& shape, StDType dtype = StDType::kBF16) {
  const Checkpoint::TensorRef ref = ck.get(name);
  const TensorInfo& info = *ref.info;
  MEGAMOE_CHECK(info.dtype == dtype, ErrorCode::kFormat, ck.path(), ": tensor '", name,
                "': expected dtype ", st_dtype_name(dtype), ", got ", st_dtype_name(info.dtype));
  MEGAMOE_CHECK(info.shape == shape, ErrorCode::kFormat, ck.path(), ": tensor '", name,
                "': expected shape ", shape_str(shape), ", got ", shape_str(info.shape));
  const int64_t n = info.numel();
  std::vector<float> out(static_cast<size_t>(n));
  const uint8_t* src = ref.data();
  if (dtype == StDType::kBF16) {
    for (int64_t i = 0; i < n; ++i) {
      uint16_t h;
      std::memcpy(&h, src + 2 * i, sizeof h);
      out[i] = bf16_to_f32(h);
    }
  } else {
    std::memcpy(out.data(), src, static_cast<size_t>(n) * sizeof(float));
  }
  for (int64_t i = 0; i < n; ++i)
    MEGAMOE_CHECK(std::isfinite(out[i]), ErrorCode::kFormat, ck.path(), ": tensor '", name,
                  "': element ", i, " is not finite");
  return out;
}

// Rows of b appended below rows of a (a fused projection: one pass over the input).
std::vector<float> stack_rows(std::vector<float> a, const std::vector<float>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

struct LayerWeights {
  std::vector<float> input_norm, post_norm;    // [d]
  std::vector<float> wqkv;                     // [3d, d]  q, k, v rows
  std::vector<float> wo;                       // [d, d]
  std::vector<float> gate;                     // [E, d]
  std::vector<float> gate_bias;                // [E]      selection only
  std::vector<float> down_proj;                // [latent, d]
  std::vector<float> routed_norm;              // [latent]
  std::vector<float> up_proj;                  // [d, latent]
  std::vector<float> shared_gate_up;           // [2 Is, d] gate rows then up rows
  std::vector<float> shared_down;              // [d, Is]
  std::vector<std::unique_ptr<MoeLayer>> moe;  // one per EP rank (one without EP)
};

// The streams of the virtual EP ranks, one per rank. Non-blocking: work on the legacy default
// stream (the copies) must never wait for a rank's call, which itself waits on the device for
// the ranks launched after it.
class RankStreams {
 public:
  RankStreams() = default;
  RankStreams(const RankStreams&) = delete;
  RankStreams& operator=(const RankStreams&) = delete;
  ~RankStreams() {
#if defined(MEGAMOE_WITH_CUDA)
    for (void* s : streams_) cudaStreamDestroy(static_cast<cudaStream_t>(s));
#endif
  }
  void create(int n) {
#if defined(MEGAMOE_WITH_CUDA)
    for (int r = 0; r < n; ++r) {
      cudaStream_t s = nullptr;
      const cudaError_t err = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
      MEGAMOE_CHECK(err == cudaSuccess, ErrorCode::kCuda, "model: cudaStreamCreateWithFlags: ",
                    cudaGetErrorString(err));
      streams_.push_back(s);
    }
#else
    fail(ErrorCode::kUnsupported, "model: EP ranks need a CUDA build (", n, " requested)");
#endif
  }
  void* at(int r) const { return streams_[static_cast<size_t>(r)]; }
  // Waits for the copies just made on the legacy default stream: one from pageable host memory
  // may return before its DMA has landed, and the rank streams are not ordered after it.
  static void wait_for_copies() {
#if defined(MEGAMOE_WITH_CUDA)
    const cudaError_t err = cudaDeviceSynchronize();
    MEGAMOE_CHECK(err == cudaSuccess, ErrorCode::kCuda, "model: cudaDeviceSynchronize: ",
                  cudaGetErrorString(err));
#endif
  }

 private:
  std::vector<void*> streams_;
};

// Device mirrors of one MoE call's tensors (only for a backend off the host).
struct MoeIo {
  Buffer x, idx, w, y;
  void ensure(Buffer& b, int64_t bytes, Device dev) {
    if (b.size() < bytes) b = Buffer(std::max<int64_t>(bytes, 1), dev);
  }
};

}  // namespace

// ---------------------------------------------------------------------------------------------
// ModelConfig / Tokenizer
// ---------------------------------------------------------------------------------------------
void ModelConfig::validate() const {
  MEGAMOE_CHECK_ARG(vocab_size > 0, "config: vocab_size must be > 0, got ", vocab_size);
  MEGAMOE_CHECK_ARG(d_model > 0 && n_heads > 0 && d_model % n_heads == 0,
                    "config: d_model must be a positive multiple of n_heads, got d_model=",
                    d_model, " n_heads=", n_heads);
  MEGAMOE_CHECK_ARG(head_dim() % 2 == 0, "config: head_dim must be even (RoPE), got ", head_dim());
  MEGAMOE_CHECK_ARG(n_layers > 0, "config: n_layers must be > 0, got ", n_layers);
  MEGAMOE_CHECK_ARG(top_k > 0 && top_k <= num_experts, "config: need 0 < top_k <= num_experts, got ",
                    top_k, " and ", num_experts);
  MEGAMOE_CHECK_ARG(latent_dim % kScaleBlock == 0 && expert_intermediate % kScaleBlock == 0 &&
                        latent_dim > 0 && expert_intermediate > 0,
                    "config: latent_dim and expert_intermediate must be positive multiples of 32, "
                    "got ", latent_dim, " and ", expert_intermediate);
  MEGAMOE_CHECK_ARG(shared_intermediate > 0, "config: shared_intermediate must be > 0");
  MEGAMOE_CHECK_ARG(rms_norm_eps > 0 && rope_theta > 0, "config: rms_norm_eps and rope_theta must be > 0");
}

Tokenizer::Tokenizer(std::vector<std::string> vocab) : vocab_(std::move(vocab)) {
  std::fill(std::begin(char_to_id_), std::end(char_to_id_), -1);
  MEGAMOE_CHECK_ARG(!vocab_.empty(), "tokenizer: empty vocabulary");
  for (size_t i = 1; i < vocab_.size(); ++i) {
    MEGAMOE_CHECK_ARG(vocab_[i].size() == 1, "tokenizer: entry ", i,
                      " must be one character, got '", vocab_[i], "'");
    const auto c = static_cast<unsigned char>(vocab_[i][0]);
    MEGAMOE_CHECK_ARG(char_to_id_[c] < 0, "tokenizer: character '", vocab_[i],
                      "' appears twice (ids ", char_to_id_[c], " and ", i, ")");
    char_to_id_[c] = static_cast<int32_t>(i);
  }
}

int32_t Tokenizer::id_of(char c) const { return char_to_id_[static_cast<unsigned char>(c)]; }

std::vector<int32_t> Tokenizer::encode(const std::string& text) const {
  std::vector<int32_t> ids(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    ids[i] = id_of(text[i]);
    MEGAMOE_CHECK_ARG(ids[i] > 0, "tokenizer: character '", text[i], "' (code ",
                      static_cast<int>(static_cast<unsigned char>(text[i])), ") at position ", i,
                      " is not in the vocabulary");
  }
  return ids;
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string s;
  for (int32_t id : ids)
    if (id > 0 && id < size()) s += vocab_[static_cast<size_t>(id)];
  return s;
}

// ---------------------------------------------------------------------------------------------
// The model
// ---------------------------------------------------------------------------------------------
struct KimiMiniModel::Impl {
  std::string path;
  ModelConfig cfg;
  Tokenizer tokenizer{std::vector<std::string>{"<pad>"}};
  ModelOptions options;
  int64_t capacity = 0;
  std::vector<float> embed;    // [V, d]
  std::vector<float> norm;     // [d]
  std::vector<float> lm_head;  // [V, d]
  std::vector<LayerWeights> layers;
  std::unique_ptr<dense::RopeTable> rope;
  std::string backend;
  Device device = Device::cpu();
  int ep_size = 1;
  RankStreams ep_streams;  // ep_size > 1: rank r's calls run on ep_streams.at(r)
  MoeIo io;
  ExpertUsage usage;

  // One sequence's KV cache: per layer [len, d] keys and values, filled up to `len`.
  struct Seq {
    std::vector<std::vector<float>> k, v;
    int64_t len = 0;
    int64_t reserved = 0;
  };

  void forward(std::vector<Seq*>& seqs, const std::vector<int32_t>& ids,
               const std::vector<int64_t>& seq_of_token, const std::vector<int64_t>& positions,
               const std::vector<int64_t>& logit_rows, std::vector<float>* logits);
  void attention(const float* qkv, int64_t n, const std::vector<Seq*>& seqs,
                 const std::vector<int64_t>& seq_of_token, const std::vector<int64_t>& positions,
                 int64_t layer, float* out) const;
  void moe(int64_t layer, const float* h, int64_t n, float* out);
};

void KimiMiniModel::Impl::attention(const float* qkv, int64_t n, const std::vector<Seq*>& seqs,
                                    const std::vector<int64_t>& seq_of_token,
                                    const std::vector<int64_t>& positions, int64_t layer,
                                    float* out) const {
  const int64_t d = cfg.d_model, heads = cfg.n_heads, hd = cfg.head_dim();
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  parallel_for(n, [&](int64_t i) {
    const Seq& s = *seqs[static_cast<size_t>(seq_of_token[i])];
    const int64_t span = positions[i] + 1;  // causal: keys 0..pos
    const float* keys = s.k[static_cast<size_t>(layer)].data();
    const float* vals = s.v[static_cast<size_t>(layer)].data();
    std::vector<float> p(static_cast<size_t>(span));
    for (int64_t h = 0; h < heads; ++h) {
      const float* q = qkv + i * 3 * d + h * hd;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < span; ++j) {
        const float* kj = keys + j * d + h * hd;
        float dot = 0.0f;
        for (int64_t c = 0; c < hd; ++c) dot += q[c] * kj[c];
        p[j] = dot * scale;
        mx = std::max(mx, p[j]);
      }
      float sum = 0.0f;
      for (int64_t j = 0; j < span; ++j) {
        p[j] = std::exp(p[j] - mx);
        sum += p[j];
      }
      const float inv = 1.0f / sum;
      float* o = out + i * d + h * hd;
      std::fill(o, o + hd, 0.0f);
      for (int64_t j = 0; j < span; ++j) {
        const float* vj = vals + j * d + h * hd;
        const float pj = p[j] * inv;
        for (int64_t c = 0; c < hd; ++c) o[c] += pj * vj[c];
      }
    }
  });
}

// Routed experts of one layer on n rows h [n, d] (post-attention-normed): router, latent
// down-projection to BF16, MoeLayer, RMSNorm on the latent, up-projection. out [n, d].
void KimiMiniModel::Impl::moe(int64_t layer, const float* h, int64_t n, float* out) {
  LayerWeights& L = layers[static_cast<size_t>(layer)];
  const int64_t d = cfg.d_model, E = cfg.num_experts, K = cfg.top_k, H = cfg.latent_dim;
  std::vector<float> logits(static_cast<size_t>(n * E));
  dense::linear(h, n, d, L.gate.data(), E, logits.data());
  std::vector<int32_t> idx(static_cast<size_t>(n * K));
  std::vector<float> w(static_cast<size_t>(n * K));
  route_sigmoid_topk(logits.data(), L.gate_bias.data(), n, E, K,
                     static_cast<float>(cfg.routed_scaling_factor), idx.data(), w.data());
  for (int32_t e : idx) usage.counts[static_cast<size_t>(layer * E + e)] += 1;

  std::vector<float> z(static_cast<size_t>(n * H));
  dense::linear(h, n, d, L.down_proj.data(), H, z.data());
  std::vector<uint16_t> zb(z.size()), yb(z.size());
  for (size_t i = 0; i < z.size(); ++i) zb[i] = bf16_from_f32(z[i]);

  if (device.type == DeviceType::kCPU) {
    L.moe.front()->forward(TensorView::contiguous(zb.data(), DType::kBF16, {n, H}),
                           TensorView::contiguous(idx.data(), DType::kI32, {n, K}),
                           TensorView::contiguous(w.data(), DType::kF32, {n, K}),
                           TensorView::contiguous(yb.data(), DType::kBF16, {n, H}));
  } else {
    const int64_t xb = n * H * 2, ib = n * K * 4, wb = n * K * 4;
    io.ensure(io.x, xb, device);
    io.ensure(io.idx, ib, device);
    io.ensure(io.w, wb, device);
    io.ensure(io.y, xb, device);
    copy_bytes(io.x.data(), device, zb.data(), Device::cpu(), xb);
    copy_bytes(io.idx.data(), device, idx.data(), Device::cpu(), ib);
    copy_bytes(io.w.data(), device, w.data(), Device::cpu(), wb);
    if (ep_size == 1) {
      L.moe.front()->forward(TensorView::contiguous(io.x.data(), DType::kBF16, {n, H}, device),
                             TensorView::contiguous(io.idx.data(), DType::kI32, {n, K}, device),
                             TensorView::contiguous(io.w.data(), DType::kF32, {n, K}, device),
                             TensorView::contiguous(io.y.data(), DType::kBF16, {n, H}, device));
      // copy_bytes runs on the legacy default stream, after the layer's work on it
      copy_bytes(yb.data(), Device::cpu(), io.y.data(), device, xb);
      L.moe.front()->check_errors();  // expert ids the device rejected, if any (never expected)
    } else {
      // Rank r takes rows [r c, min(n, (r+1) c)), c = ceil(n / R). Every rank is called, those
      // past the last row with none: a group call needs all of them. The forwards only enqueue
      // work, so all ranks are in flight together before the first wait.
      const int64_t chunk = (n + ep_size - 1) / ep_size;
      RankStreams::wait_for_copies();
      auto rows_of = [&](const Buffer& b, int64_t first, int64_t rows, int64_t width, DType dtype) {
        void* p = rows == 0 ? b.data()
                            : static_cast<uint8_t*>(b.data()) + first * width * dtype_bytes(dtype);
        return TensorView::contiguous(p, dtype, {rows, width}, device);
      };
      for (int r = 0; r < ep_size; ++r) {
        const int64_t first = std::min(n, r * chunk);
        const int64_t rows = std::min(n, first + chunk) - first;
        L.moe[static_cast<size_t>(r)]->forward(
            rows_of(io.x, first, rows, H, DType::kBF16), rows_of(io.idx, first, rows, K, DType::kI32),
            rows_of(io.w, first, rows, K, DType::kF32), rows_of(io.y, first, rows, H, DType::kBF16),
            ep_streams.at(r));
      }
      // Waits for every rank's stream; throws the device-side errors (a timeout, an expert id),
      // if any. Then y is complete and the copy needs no stream order.
      for (int r = 0; r < ep_size; ++r) L.moe[static_cast<size_t>(r)]->check_errors(ep_streams.at(r));
      copy_bytes(yb.data(), Device::cpu(), io.y.data(), device, xb);
    }
  }
  for (size_t i = 0; i < z.size(); ++i) z[i] = bf16_to_f32(yb[i]);
  dense::rms_norm(z.data(), n, H, L.routed_norm.data(), cfg.rms_norm_eps, z.data());
  dense::linear(z.data(), n, H, L.up_proj.data(), d, out);
}

void KimiMiniModel::Impl::forward(std::vector<Seq*>& seqs, const std::vector<int32_t>& ids,
                                  const std::vector<int64_t>& seq_of_token,
                                  const std::vector<int64_t>& positions,
                                  const std::vector<int64_t>& logit_rows,
                                  std::vector<float>* logits) {
  const int64_t n = static_cast<int64_t>(ids.size());
  const int64_t d = cfg.d_model, V = cfg.vocab_size, Is = cfg.shared_intermediate;
  MEGAMOE_CHECK(n <= capacity, ErrorCode::kInternal, "forward: ", n,
                " tokens exceed the MoE capacity ", capacity);
  std::vector<float> x(static_cast<size_t>(n * d)), hn(x.size()), qkv(static_cast<size_t>(n * 3 * d)),
      att(x.size()), o(x.size()), r(x.size()), gu(static_cast<size_t>(n * 2 * Is)),
      act(static_cast<size_t>(n * Is));
  for (int64_t i = 0; i < n; ++i) {
    MEGAMOE_CHECK_ARG(ids[i] > 0 && ids[i] < V, "forward: token id ", ids[i], " outside [1, ", V, ")");
    std::memcpy(&x[i * d], &embed[static_cast<size_t>(ids[i] * d)], d * sizeof(float));
  }
  for (int64_t l = 0; l < cfg.n_layers; ++l) {
    LayerWeights& L = layers[static_cast<size_t>(l)];
    // ---- attention ----
    dense::rms_norm(x.data(), n, d, L.input_norm.data(), cfg.rms_norm_eps, hn.data());
    dense::linear(hn.data(), n, d, L.wqkv.data(), 3 * d, qkv.data());
    // RoPE on q and k of each row (rows are [q | k | v], each d wide)
    dense::apply_rope(qkv.data(), n, 3 * d, cfg.n_heads, positions.data(), *rope);
    dense::apply_rope(qkv.data() + d, n, 3 * d, cfg.n_heads, positions.data(), *rope);
    for (int64_t i = 0; i < n; ++i) {  // keys and values into each sequence's cache
      Seq& s = *seqs[static_cast<size_t>(seq_of_token[i])];
      std::memcpy(&s.k[l][positions[i] * d], &qkv[i * 3 * d + d], d * sizeof(float));
      std::memcpy(&s.v[l][positions[i] * d], &qkv[i * 3 * d + 2 * d], d * sizeof(float));
    }
    attention(qkv.data(), n, seqs, seq_of_token, positions, l, att.data());
    dense::linear(att.data(), n, d, L.wo.data(), d, o.data());
    for (size_t i = 0; i < x.size(); ++i) x[i] += o[i];
    // ---- MoE block: routed experts (megamoe) + shared expert ----
    dense::rms_norm(x.data(), n, d, L.post_norm.data(), cfg.rms_norm_eps, hn.data());
    moe(l, hn.data(), n, r.data());
    dense::linear(hn.data(), n, d, L.shared_gate_up.data(), 2 * Is, gu.data());
    dense::situ_rows(gu.data(), n, Is, static_cast<float>(cfg.situ_beta),
                     static_cast<float>(cfg.situ_linear_beta), act.data());
    dense::linear(act.data(), n, Is, L.shared_down.data(), d, o.data());
    for (size_t i = 0; i < x.size(); ++i) x[i] += r[i] + o[i];
  }
  const int64_t m = static_cast<int64_t>(logit_rows.size());
  std::vector<float> last(static_cast<size_t>(m * d));
  for (int64_t j = 0; j < m; ++j)
    std::memcpy(&last[j * d], &x[logit_rows[j] * d], d * sizeof(float));
  dense::rms_norm(last.data(), m, d, norm.data(), cfg.rms_norm_eps, last.data());
  logits->assign(static_cast<size_t>(m * V), 0.0f);
  dense::linear(last.data(), m, d, lm_head.data(), V, logits->data());
}

KimiMiniModel::KimiMiniModel(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
KimiMiniModel::KimiMiniModel(KimiMiniModel&&) noexcept = default;
KimiMiniModel& KimiMiniModel::operator=(KimiMiniModel&&) noexcept = default;
KimiMiniModel::~KimiMiniModel() = default;

const ModelConfig& KimiMiniModel::config() const { return impl_->cfg; }
const Tokenizer& KimiMiniModel::tokenizer() const { return impl_->tokenizer; }
const std::string& KimiMiniModel::moe_backend() const { return impl_->backend; }
int KimiMiniModel::ep_size() const { return impl_->ep_size; }
const std::string& KimiMiniModel::path() const { return impl_->path; }
const ExpertUsage& KimiMiniModel::expert_usage() const { return impl_->usage; }
void KimiMiniModel::reset_expert_usage() {
  std::fill(impl_->usage.counts.begin(), impl_->usage.counts.end(), 0);
}

KimiMiniModel KimiMiniModel::load(const std::string& path, const ModelOptions& options) {
  auto impl = std::make_unique<Impl>();
  impl->path = path;
  impl->options = options;
  const std::string config_path = (fs::path(path) / kConfigFile).string();
  MEGAMOE_CHECK(fs::exists(config_path), ErrorCode::kIo, "model ", path, ": no ", kConfigFile,
                " (train with examples/kimi_mini/train.py)");
  const nlohmann::json j = read_json(config_path);
  ModelConfig& c = impl->cfg;
  c.vocab_size = json_field<int64_t>(j, "vocab_size", config_path);
  c.d_model = json_field<int64_t>(j, "d_model", config_path);
  c.n_layers = json_field<int64_t>(j, "n_layers", config_path);
  c.n_heads = json_field<int64_t>(j, "n_heads", config_path);
  c.max_seq_len = json_field<int64_t>(j, "max_seq_len", config_path);
  c.rope_theta = json_field<double>(j, "rope_theta", config_path);
  c.rms_norm_eps = json_field<double>(j, "rms_norm_eps", config_path);
  c.num_experts = json_field<int64_t>(j, "num_experts", config_path);
  c.top_k = json_field<int64_t>(j, "top_k", config_path);
  c.latent_dim = json_field<int64_t>(j, "latent_dim", config_path);
  c.expert_intermediate = json_field<int64_t>(j, "expert_intermediate", config_path);
  c.shared_intermediate = json_field<int64_t>(j, "shared_intermediate", config_path);
  c.routed_scaling_factor = json_field<double>(j, "routed_scaling_factor", config_path);
  c.situ_beta = json_field<double>(j, "situ_beta", config_path);
  c.situ_linear_beta = json_field<double>(j, "situ_linear_beta", config_path);
  c.tensor_prefix = json_field<std::string>(j, "tensor_prefix", config_path);
  const std::string act = json_field<std::string>(j, "hidden_act", config_path);
  MEGAMOE_CHECK(act == "situ", ErrorCode::kFormat, config_path,
                ": hidden_act: expected 'situ', got '", act, "'");
  c.validate();
  MEGAMOE_CHECK(j.contains("tokenizer"), ErrorCode::kFormat, config_path, ": missing 'tokenizer'");
  impl->tokenizer =
      Tokenizer(json_field<std::vector<std::string>>(j.at("tokenizer"), "vocab", config_path));
  MEGAMOE_CHECK(impl->tokenizer.size() == c.vocab_size, ErrorCode::kFormat, config_path,
                ": tokenizer has ", impl->tokenizer.size(), " entries, vocab_size is ",
                c.vocab_size);

  // ---- the routed experts' layer configuration, and with ep_size > 1 the EP group (before the
  // checkpoint is read: a bad ep_size or backend fails at once) ----
  impl->capacity = options.max_batch_tokens > 0 ? options.max_batch_tokens : kDefaultCapacityTokens;
  const int ep_size = options.ep_size;
  MEGAMOE_CHECK_ARG(ep_size >= 1, "model: ep_size must be >= 1, got ", ep_size);
  LayerConfig lc;
  lc.shape.hidden = c.latent_dim;
  lc.shape.intermediate = c.expert_intermediate;
  lc.shape.num_experts = c.num_experts;
  lc.shape.top_k = c.top_k;
  lc.activation = Activation::situ(static_cast<float>(c.situ_beta),
                                   static_cast<float>(c.situ_linear_beta));
  lc.fast_math = options.fast_math;
  lc.precision = options.precision;
  lc.fp8_min_rows_per_expert = options.fp8_min_rows_per_expert;
  lc.ep_size = ep_size;
  // A call's tokens are split over the ranks, ceil(n / R) each at most.
  lc.max_tokens_per_rank = (impl->capacity + ep_size - 1) / ep_size;
  lc.validate();  // names an ep_size that does not divide num_experts
  std::vector<std::shared_ptr<EpGroup>> ep_groups;
  if (ep_size > 1) {
    const std::string chosen =
        options.backend == "auto" ? available_backends().front() : options.backend;
    MEGAMOE_CHECK_ARG(chosen == "sm90" || chosen == "cpu", "model: unknown backend '",
                      options.backend, "' (expected auto, sm90 or cpu)");
    MEGAMOE_CHECK(chosen == "sm90", ErrorCode::kUnsupported, "model: ep_size ", ep_size,
                  " runs each MoE layer on ", ep_size, " virtual ranks of one GPU, which needs "
                  "the sm90 backend; the backend here is '", chosen, "'",
                  options.backend == "auto" ? " (the best available)" : "");
    // One group for all layers: they have one configuration, and their calls run in one order
    // on every rank's stream, as layers sharing a group must.
    EpOptions eo;
    // A call has at most `capacity` tokens over all ranks, and each token sends one rank at most
    // min(K, E/R) rows: the exact bound (the default counts R * ceil(capacity / R) tokens).
    eo.max_recv_rows = impl->capacity * std::min<int64_t>(c.top_k, c.num_experts / ep_size);
    ep_groups = EpGroup::create_virtual(ep_size, lc, eo);
    impl->ep_streams.create(ep_size);
  }
  impl->ep_size = ep_size;

  // ---- checkpoint: a single file or an index with shards ----
  const fs::path index = fs::path(path) / kSafetensorsIndexName;
  const fs::path single = fs::path(path) / kSingleFileCheckpoint;
  const Checkpoint ck = Checkpoint::open(fs::exists(index) ? index.string()
                                                           : fs::exists(single) ? single.string()
                                                                                : path);
  const int64_t d = c.d_model, V = c.vocab_size, E = c.num_experts, H = c.latent_dim,
                Is = c.shared_intermediate;
  const std::string& pre = c.tensor_prefix;
  const std::string top = pre.substr(0, pre.rfind('.') == std::string::npos ? 0 : pre.rfind('.'));
  impl->embed = load_dense(ck, pre + ".embed_tokens.weight", {V, d});
  impl->norm = load_dense(ck, pre + ".norm.weight", {d});
  impl->lm_head = load_dense(ck, (top.empty() ? "" : top + ".") + "lm_head.weight", {V, d});

  const std::vector<MoeLayerInfo> moe_layers = find_moe_layers(ck);
  MEGAMOE_CHECK(static_cast<int64_t>(moe_layers.size()) == c.n_layers, ErrorCode::kFormat,
                ck.path(), ": expected ", c.n_layers, " MoE layers, found ", moe_layers.size());

  impl->layers.resize(static_cast<size_t>(c.n_layers));
  for (int64_t l = 0; l < c.n_layers; ++l) {
    LayerWeights& L = impl->layers[static_cast<size_t>(l)];
    const std::string lp = pre + ".layers." + std::to_string(l);
    const std::string mp = lp + ".block_sparse_moe";
    L.input_norm = load_dense(ck, lp + ".input_layernorm.weight", {d});
    L.post_norm = load_dense(ck, lp + ".post_attention_layernorm.weight", {d});
    L.wqkv = stack_rows(stack_rows(load_dense(ck, lp + ".self_attn.q_proj.weight", {d, d}),
                                   load_dense(ck, lp + ".self_attn.k_proj.weight", {d, d})),
                        load_dense(ck, lp + ".self_attn.v_proj.weight", {d, d}));
    L.wo = load_dense(ck, lp + ".self_attn.o_proj.weight", {d, d});
    L.gate = load_dense(ck, mp + ".gate.weight", {E, d});
    L.gate_bias = load_dense(ck, mp + ".gate.e_score_correction_bias", {E}, StDType::kF32);
    L.down_proj = load_dense(ck, mp + ".routed_expert_down_proj.weight", {H, d});
    L.routed_norm = load_dense(ck, mp + ".routed_expert_norm.weight", {H});
    L.up_proj = load_dense(ck, mp + ".routed_expert_up_proj.weight", {d, H});
    L.shared_gate_up = stack_rows(load_dense(ck, mp + ".shared_experts.gate_proj.weight", {Is, d}),
                                  load_dense(ck, mp + ".shared_experts.up_proj.weight", {Is, d}));
    L.shared_down = load_dense(ck, mp + ".shared_experts.down_proj.weight", {d, Is});

    // ---- routed experts: the normal loading path (checkpoint -> canonical -> MoeLayer) ----
    const MoeLayerInfo& info = moe_layers[static_cast<size_t>(l)];
    MEGAMOE_CHECK(info.prefix == mp && info.layer_index == l, ErrorCode::kFormat, ck.path(),
                  ": MoE layer ", l, " expected at prefix '", mp, "', found '", info.prefix, "'");
    MEGAMOE_CHECK(info.convention == ExpertConvention::kPerExpert && info.num_experts == E &&
                      info.hidden == H && info.intermediate == c.expert_intermediate &&
                      !info.has_bias,
                  ErrorCode::kFormat, ck.path(), ": MoE layer ", l, " is ",
                  expert_convention_name(info.convention), " E=", info.num_experts,
                  " H=", info.hidden, " I=", info.intermediate, (info.has_bias ? " with" : " without"),
                  " bias; config expects kimi-k3 E=", E, " H=", H, " I=", c.expert_intermediate,
                  " without bias");
    for (int r = 0; r < ep_size; ++r) {
      LayerConfig rank_config = lc;
      rank_config.ep_rank = r;
      MoeWeights w = load_moe_layer(ck, info, r, ep_size);
      if (options.weights_hook) options.weights_hook(l, w);
      L.moe.push_back(ep_size == 1
                          ? std::make_unique<MoeLayer>(rank_config, std::move(w), options.backend)
                          : std::make_unique<MoeLayer>(rank_config, std::move(w),
                                                       ep_groups[static_cast<size_t>(r)],
                                                       options.backend));
    }
  }
  impl->backend = impl->layers.front().moe.front()->backend();
  impl->device = impl->layers.front().moe.front()->device();
  impl->rope = std::make_unique<dense::RopeTable>(c.head_dim(), kRopePositions, c.rope_theta);
  impl->usage.num_layers = c.n_layers;
  impl->usage.num_experts = E;
  impl->usage.counts.assign(static_cast<size_t>(c.n_layers * E), 0);
  return KimiMiniModel(std::move(impl));
}

namespace {
int32_t argmax_row(const float* row, int64_t n) {
  int64_t best = 0;  // first maximum, as torch.argmax
  for (int64_t i = 1; i < n; ++i)
    if (row[i] > row[best]) best = i;
  return static_cast<int32_t>(best);
}
}  // namespace

std::vector<float> KimiMiniModel::last_logits(const std::vector<std::string>& prompts) {
  Impl& m = *impl_;
  const int64_t d = m.cfg.d_model;
  std::vector<Impl::Seq> seqs(prompts.size());
  std::vector<Impl::Seq*> ptrs;
  std::vector<int32_t> ids;
  std::vector<int64_t> seq_of, pos, rows;
  for (size_t s = 0; s < prompts.size(); ++s) {
    const std::vector<int32_t> p = m.tokenizer.encode(prompts[s]);
    MEGAMOE_CHECK_ARG(!p.empty(), "last_logits: prompt ", s, " is empty");
    seqs[s].k.assign(static_cast<size_t>(m.cfg.n_layers), std::vector<float>(p.size() * d));
    seqs[s].v = seqs[s].k;
    ptrs.push_back(&seqs[s]);
    for (size_t i = 0; i < p.size(); ++i) {
      ids.push_back(p[i]);
      seq_of.push_back(static_cast<int64_t>(s));
      pos.push_back(static_cast<int64_t>(i));
    }
    rows.push_back(static_cast<int64_t>(ids.size()) - 1);
  }
  std::vector<float> logits;
  m.forward(ptrs, ids, seq_of, pos, rows, &logits);
  return logits;
}

std::vector<std::string> KimiMiniModel::generate(const std::vector<std::string>& prompts,
                                                 int64_t max_new_tokens, char stop) {
  Impl& m = *impl_;
  MEGAMOE_CHECK_ARG(max_new_tokens > 0, "generate: max_new_tokens must be > 0, got ",
                    max_new_tokens);
  const int64_t d = m.cfg.d_model, V = m.cfg.vocab_size, B = static_cast<int64_t>(prompts.size());
  MEGAMOE_CHECK_ARG(B <= m.capacity, "generate: ", B, " prompts exceed the MoE capacity ",
                    m.capacity);
  const int32_t stop_id = m.tokenizer.id_of(stop);

  std::vector<std::vector<int32_t>> prompt_ids(prompts.size());
  std::vector<Impl::Seq> seqs(prompts.size());
  for (int64_t s = 0; s < B; ++s) {
    prompt_ids[s] = m.tokenizer.encode(prompts[s]);
    MEGAMOE_CHECK_ARG(!prompt_ids[s].empty(), "generate: prompt ", s, " is empty");
    const int64_t len = static_cast<int64_t>(prompt_ids[s].size()) + max_new_tokens;
    MEGAMOE_CHECK_ARG(len <= m.rope->max_pos, "generate: prompt ", s, " plus ", max_new_tokens,
                      " new tokens exceeds ", m.rope->max_pos, " positions");
    seqs[s].k.assign(static_cast<size_t>(m.cfg.n_layers), std::vector<float>(len * d));
    seqs[s].v = seqs[s].k;
    seqs[s].reserved = len;
  }
  std::vector<Impl::Seq*> ptrs;
  for (auto& s : seqs) ptrs.push_back(&s);

  std::vector<std::vector<int32_t>> out(prompts.size());
  std::vector<bool> done(prompts.size(), false);
  std::vector<int32_t> next(prompts.size(), 0);

  // ---- prefill, in chunks of whole prompts that fit the MoE capacity ----
  for (int64_t s0 = 0; s0 < B;) {
    std::vector<int32_t> ids;
    std::vector<int64_t> seq_of, pos, rows, members;
    int64_t s = s0;
    while (s < B) {
      const int64_t len = static_cast<int64_t>(prompt_ids[s].size());
      if (!members.empty() && static_cast<int64_t>(ids.size()) + len > m.capacity) break;
      MEGAMOE_CHECK_ARG(len <= m.capacity, "generate: prompt ", s, " has ", len,
                        " tokens, more than the MoE capacity ", m.capacity);
      for (int64_t i = 0; i < len; ++i) {
        ids.push_back(prompt_ids[s][i]);
        seq_of.push_back(s);
        pos.push_back(i);
      }
      rows.push_back(static_cast<int64_t>(ids.size()) - 1);
      members.push_back(s);
      ++s;
    }
    std::vector<float> logits;
    m.forward(ptrs, ids, seq_of, pos, rows, &logits);
    for (size_t j = 0; j < members.size(); ++j) {
      const int64_t q = members[j];
      seqs[q].len = static_cast<int64_t>(prompt_ids[q].size());
      next[q] = argmax_row(&logits[j * V], V);
    }
    s0 = s;
  }

  // ---- decode: one token per running sequence per step ----
  for (int64_t step = 0; step < max_new_tokens; ++step) {
    std::vector<int32_t> ids;
    std::vector<int64_t> seq_of, pos, rows;
    for (int64_t s = 0; s < B; ++s) {
      if (done[s]) continue;
      if (next[s] == stop_id) {
        done[s] = true;
        continue;
      }
      out[s].push_back(next[s]);
      if (step + 1 == max_new_tokens) {
        done[s] = true;
        continue;
      }
      ids.push_back(next[s]);
      seq_of.push_back(s);
      pos.push_back(seqs[s].len);
      rows.push_back(static_cast<int64_t>(ids.size()) - 1);
    }
    if (ids.empty()) break;
    std::vector<float> logits;
    m.forward(ptrs, ids, seq_of, pos, rows, &logits);
    for (size_t j = 0; j < ids.size(); ++j) {
      const int64_t s = seq_of[j];
      seqs[s].len += 1;
      next[s] = argmax_row(&logits[j * V], V);
    }
  }
  std::vector<std::string> texts;
  texts.reserve(prompts.size());
  for (const auto& o : out) texts.push_back(m.tokenizer.decode(o));
  return texts;
}

// ---------------------------------------------------------------------------------------------
// Task and evaluation
// ---------------------------------------------------------------------------------------------
std::vector<Problem> load_problems(const std::string& path) {
  std::ifstream f(path);
  MEGAMOE_CHECK(f.good(), ErrorCode::kIo, path, ": cannot open");
  std::vector<Problem> out;
  std::string line;
  int64_t line_no = 0;
  while (std::getline(f, line)) {
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = path + ":" + std::to_string(line_no);
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      fail(ErrorCode::kFormat, where, ": not valid JSON (", e.what(), ")");
    }
    Problem p;
    p.question = json_field<std::string>(j, "question", where);
    p.answer = json_field<std::string>(j, "answer", where);
    p.final = json_field<int64_t>(j, "final", where);
    out.push_back(std::move(p));
  }
  MEGAMOE_CHECK(!out.empty(), ErrorCode::kFormat, path, ": no problems");
  return out;
}

std::optional<int64_t> final_answer(const std::string& generated) {
  const size_t at = generated.rfind("####");
  if (at == std::string::npos) return std::nullopt;
  size_t i = at + 4;
  while (i < generated.size() && generated[i] == ' ') ++i;
  bool neg = false;
  if (i < generated.size() && generated[i] == '-') {
    neg = true;
    ++i;
  }
  constexpr int64_t kMaxDigits = 15;  // fits int64
  int64_t v = 0, digits = 0;
  while (i < generated.size() && generated[i] >= '0' && generated[i] <= '9' && digits < kMaxDigits) {
    v = v * 10 + (generated[i] - '0');
    ++i;
    ++digits;
  }
  if (digits == 0) return std::nullopt;
  return neg ? -v : v;
}

EvalReport evaluate(KimiMiniModel& model, const std::vector<Problem>& problems,
                    const EvalOptions& options) {
  MEGAMOE_CHECK_ARG(options.batch > 0, "evaluate: batch must be > 0, got ", options.batch);
  EvalReport r;
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t n = static_cast<int64_t>(problems.size());
  for (int64_t b = 0; b < n; b += options.batch) {
    std::vector<std::string> prompts;
    for (int64_t i = b; i < std::min(n, b + options.batch); ++i) prompts.push_back(problems[i].prompt());
    const std::vector<std::string> answers = model.generate(prompts, kMaxNewTokens);
    for (size_t j = 0; j < answers.size(); ++j) {
      const Problem& p = problems[static_cast<size_t>(b) + j];
      const auto got = final_answer(answers[j]);
      const bool ok = got.has_value() && *got == p.final;
      r.answers.push_back(answers[j]);
      r.is_correct.push_back(ok);
      r.correct += ok ? 1 : 0;
      r.generated_tokens += static_cast<int64_t>(answers[j].size()) + 1;
    }
    r.total = static_cast<int64_t>(r.answers.size());
    if (options.progress) options.progress(r.total, n);
    if (options.max_failures >= 0 && r.total - r.correct > options.max_failures && r.total < n) {
      r.stopped_early = true;
      break;
    }
  }
  r.accuracy = r.total ? static_cast<double>(r.correct) / static_cast<double>(r.total) : 0.0;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

std::string default_model_dir() {
  // NOTES: __FILE__ is this source file's absolute path (CMake passes absolute paths), so a
  // build finds the example model of the tree it was built from when run from anywhere.
  const fs::path candidates[] = {
      fs::current_path() / "examples" / "kimi_mini",
      fs::path(__FILE__).parent_path().parent_path(),  // examples/kimi_mini/cpp/kimi_mini.cpp
  };
  for (const auto& c : candidates)
    if (fs::exists(c / kConfigFile)) return c.string();
  return "";
}

}  // namespace megamoe::model
