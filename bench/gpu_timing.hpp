// gpu_timing.hpp: CUDA stream and graph helpers, and the timing protocol of the GPU benchmarks
// (bench/*.cu; the GPU tests use the stream and graph helpers too, through sm90_test_util.hpp).
//
// - Stream: a non-blocking stream owned by a scope.
// - StreamGraph: the work a callable puts on a stream, captured and instantiated.
// - device_copy_tbs(): the copy ceiling (bytes read + written per second).
// - time_graph_launches(): time per launch of a graph, as targets.md's protocol asks.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "megamoe/buffer.hpp"
#include "runtime/cuda_check.hpp"

namespace megamoe::bench {

// A non-blocking CUDA stream, destroyed with its owner (also when an ASSERT returns early).
class Stream {
 public:
  Stream() { MEGAMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)); }
  ~Stream() { cudaStreamDestroy(stream_); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  operator cudaStream_t() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

// A CUDA graph of the work `issue` puts on `stream` (captured in global mode), instantiated.
class StreamGraph {
 public:
  template <class F>
  StreamGraph(cudaStream_t stream, F&& issue) {
    MEGAMOE_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    issue();
    MEGAMOE_CUDA_CHECK(cudaStreamEndCapture(stream, &graph_));
    MEGAMOE_CUDA_CHECK(cudaGraphInstantiate(&exec_, graph_, 0));
  }
  ~StreamGraph() {
    cudaGraphExecDestroy(exec_);
    cudaGraphDestroy(graph_);
  }
  StreamGraph(const StreamGraph&) = delete;
  StreamGraph& operator=(const StreamGraph&) = delete;
  void launch(cudaStream_t stream) const { MEGAMOE_CUDA_CHECK(cudaGraphLaunch(exec_, stream)); }

 private:
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

// The copy ceiling of the GPU benchmarks, in TB/s (bytes read + written): five back-to-back 2 GiB
// device-to-device copies after one untimed, between two events.
inline double device_copy_tbs() {
  const int64_t bytes = int64_t(2) << 30;
  Buffer a(bytes, Device::cuda()), b(bytes, Device::cuda());
  cudaEvent_t t0, t1;
  MEGAMOE_CUDA_CHECK(cudaEventCreate(&t0));
  MEGAMOE_CUDA_CHECK(cudaEventCreate(&t1));
  MEGAMOE_CUDA_CHECK(cudaMemcpy(b.data(), a.data(), bytes, cudaMemcpyDeviceToDevice));
  MEGAMOE_CUDA_CHECK(cudaEventRecord(t0));
  for (int i = 0; i < 5; ++i)
    MEGAMOE_CUDA_CHECK(cudaMemcpyAsync(b.data(), a.data(), bytes, cudaMemcpyDeviceToDevice));
  MEGAMOE_CUDA_CHECK(cudaEventRecord(t1));
  MEGAMOE_CUDA_CHECK(cudaEventSynchronize(t1));
  float ms = 0;
  MEGAMOE_CUDA_CHECK(cudaEventElapsedTime(&ms, t0, t1));
  MEGAMOE_CUDA_CHECK(cudaEventDestroy(t0));
  MEGAMOE_CUDA_CHECK(cudaEventDestroy(t1));
  return 5 * 2.0 * bytes / (ms * 1e-3) / 1e12;
}

// Time per launch of a graph of `launches` launches, as the benchmark protocol of targets.md asks
// (CUDA events around many launches after warm-up): each of `samples` samples brackets `reps`
// replays (about 2 ms of work, at most 16) enqueued behind one untimed replay, so the GPU is busy
// from the start event on and the host's graph submission is not inside the events. single: the
// GEMM benchmark's earlier protocol, events around one replay submitted to an idle GPU.
struct GraphTiming {
  double median_us = 0, min_us = 0, single_median_us = 0;
  int reps = 0;
};
inline GraphTiming time_graph_launches(const StreamGraph& graph, cudaStream_t stream, int launches,
                                       int samples) {
  cudaEvent_t e0, e1;
  MEGAMOE_CUDA_CHECK(cudaEventCreate(&e0));
  MEGAMOE_CUDA_CHECK(cudaEventCreate(&e1));
  auto median = [](std::vector<float> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; };
  std::vector<float> single(static_cast<size_t>(samples)), ms(static_cast<size_t>(samples));
  for (auto& t : single) {
    MEGAMOE_CUDA_CHECK(cudaEventRecord(e0, stream));
    graph.launch(stream);
    MEGAMOE_CUDA_CHECK(cudaEventRecord(e1, stream));
    MEGAMOE_CUDA_CHECK(cudaEventSynchronize(e1));
    MEGAMOE_CUDA_CHECK(cudaEventElapsedTime(&t, e0, e1));
  }
  GraphTiming out;
  const double replay_ms = median(single);
  out.reps = std::clamp(static_cast<int>(std::ceil(2.0 / std::max(replay_ms, 1e-3))), 1, 16);
  for (auto& t : ms) {
    graph.launch(stream);  // untimed: the GPU is busy when e0 is taken
    MEGAMOE_CUDA_CHECK(cudaEventRecord(e0, stream));
    for (int r = 0; r < out.reps; ++r) graph.launch(stream);
    MEGAMOE_CUDA_CHECK(cudaEventRecord(e1, stream));
    MEGAMOE_CUDA_CHECK(cudaEventSynchronize(e1));
    MEGAMOE_CUDA_CHECK(cudaEventElapsedTime(&t, e0, e1));
    t /= static_cast<float>(out.reps);
  }
  MEGAMOE_CUDA_CHECK(cudaEventDestroy(e0));
  MEGAMOE_CUDA_CHECK(cudaEventDestroy(e1));
  const double per = 1e3 / launches;  // ms per replay -> us per launch
  out.median_us = median(ms) * per;
  out.min_us = *std::min_element(ms.begin(), ms.end()) * per;
  out.single_median_us = replay_ms * per;
  return out;
}

}  // namespace megamoe::bench
