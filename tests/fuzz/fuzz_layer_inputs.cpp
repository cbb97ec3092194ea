// libFuzzer target: arbitrary call arguments to a tiny CPU MoeLayer (docs/reliability.md).
//
// The input bytes choose the token count (0 .. capacity + 2), the raw bits of x (BF16: NaN, Inf,
// subnormals included), topk_idx (any int32: out-of-range ids, -1, repeats), topk_weights (any
// FP32), and a perturbation of one tensor view (dtype, ndim, strides, device, null data). Every
// buffer is allocated at exactly the size its view claims, so AddressSanitizer reports any read or
// write outside it. The call must either succeed or throw megamoe::Error; on success every row of
// y is written and a token whose slots are all -1 is exactly zero.
#include <cstdint>
#include <cstdio>
#include <utility>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "megamoe/error.hpp"
#include "megamoe/layer.hpp"
#include "megamoe/parallel.hpp"
#include "megamoe/weights.hpp"

namespace {

constexpr int64_t kH = 64, kI = 32, kE = 8, kK = 2, kCapacity = 8;
constexpr uint16_t kPoison = 0x5B5B;

// Reads the fuzz input front to back; zeros once it runs out.
struct Reader {
  const uint8_t* p;
  size_t n;
  template <typename T>
  T take() {
    T v{};
    const size_t k = n < sizeof(T) ? n : sizeof(T);
    std::memcpy(&v, p, k);
    p += k;
    n -= k;
    return v;
  }
};

megamoe::MoeLayer& layer() {
  static std::unique_ptr<megamoe::MoeLayer> l = [] {
    megamoe::set_num_threads(1);
    megamoe::LayerConfig cfg;
    cfg.shape = {kH, kI, kE, kK};
    cfg.max_tokens_per_rank = kCapacity;
    cfg.activation = megamoe::Activation::situ();
    return std::make_unique<megamoe::MoeLayer>(cfg, megamoe::synthetic_weights(cfg, 1), "cpu");
  }();
  return *l;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace megamoe;
  Reader r{data, size};
  const int64_t t = r.take<uint8_t>() % (kCapacity + 3);
  const uint8_t perturb = r.take<uint8_t>();
  // Exact-size heap buffers (vectors of exactly the claimed element count).
  std::vector<uint16_t> x(static_cast<size_t>(t * kH));
  std::vector<int32_t> idx(static_cast<size_t>(t * kK));
  std::vector<float> w(static_cast<size_t>(t * kK));
  std::vector<uint16_t> y(static_cast<size_t>(t * kH), kPoison);
  for (auto& v : idx) {
    // Mostly plausible ids, sometimes any int32.
    const uint8_t sel = r.take<uint8_t>();
    v = (sel & 0x80) ? r.take<int32_t>() : static_cast<int32_t>(sel % (kE + 2)) - 1;
  }
  for (auto& v : w) v = (r.take<uint8_t>() & 1) ? r.take<float>() : 0.5f;
  for (auto& v : x) v = r.take<uint16_t>();

  TensorView views[4] = {
      TensorView::contiguous(x.data(), DType::kBF16, {t, kH}),
      TensorView::contiguous(idx.data(), DType::kI32, {t, kK}),
      TensorView::contiguous(w.data(), DType::kF32, {t, kK}),
      TensorView::contiguous(y.data(), DType::kBF16, {t, kH}),
  };
  TensorView& v = views[perturb % 4];
  switch ((perturb / 4) % 8) {
    case 0: break;                                                       // unperturbed
    case 1: v.dtype = static_cast<DType>((static_cast<int>(v.dtype) + 1) % 5); break;
    case 2: std::swap(v.strides[0], v.strides[1]); break;                // transposed
    case 3: v.strides[0] = 0; break;                                     // broadcast rows
    case 4: v.ndim = static_cast<int>(r.take<int8_t>()); break;          // any ndim
    case 5: v.device = Device::cuda(r.take<uint8_t>() % 4); break;
    case 6: if (t > 0) v.data = nullptr; break;
    case 7: v.shape[0] = -static_cast<int64_t>(r.take<uint8_t>()); break;
  }
  bool accepted = false;
  try {
    layer().forward(views[0], views[1], views[2], views[3]);
    accepted = true;
  } catch (const Error&) {
    // Rejected: y must be untouched.
    for (uint16_t e : y)
      if (e != kPoison) {
        std::fprintf(stderr, "fuzz_layer_inputs: a rejected call wrote into y\n");
        std::abort();
      }
  }
  // Outputs are O(1) for weights in [-1, 1] (synthetic weights, situ bounds g and u), so a value
  // equal to the poison means "not written" only then.
  bool sane_weights = true;
  for (float e : w) sane_weights &= e >= -1.0f && e <= 1.0f;
  if (accepted && sane_weights && (perturb / 4) % 8 == 0) {
    for (int64_t tok = 0; tok < t; ++tok) {
      bool empty = true;
      for (int64_t k = 0; k < kK; ++k) empty &= idx[tok * kK + k] == -1;
      for (int64_t j = 0; j < kH; ++j) {
        const uint16_t e = y[tok * kH + j];
        if (e == kPoison || (empty && e != 0)) {
          std::fprintf(stderr, "fuzz_layer_inputs: token %lld column %lld not written (0x%04x)\n",
                       static_cast<long long>(tok), static_cast<long long>(j), e);
          std::abort();
        }
      }
    }
  }
  return 0;
}
