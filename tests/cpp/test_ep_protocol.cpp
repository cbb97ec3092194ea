// The expert-parallel window ABI on the host (kernels/ep/ep_protocol.hpp): the region layout every
// rank and kernel shares, and the return address of a received row (ep::return_slot), which
// ep_return's copy and the MegaMoE kernel's L2 epilogue both use.
#include <gtest/gtest.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "ep/ep_protocol.hpp"

namespace megamoe::ep {
namespace {

// Every received place (s * t_max + t) * K + k goes back to rank s, combine slot t * K + k.
TEST(EpProtocol, ReturnSlotInvertsTheReceivedPlace) {
  for (uint32_t ranks : {1u, 2u, 8u, 64u}) {
    for (uint32_t t_max : {1u, 3u, 64u}) {
      for (uint32_t k : {1u, 4u, 16u}) {
        for (uint32_t s = 0; s < ranks; ++s) {
          for (uint32_t t = 0; t < t_max; ++t) {
            for (uint32_t j = 0; j < k; ++j) {
              const uint32_t place = (s * t_max + t) * k + j;
              const ReturnSlot to = return_slot(place, k, t_max);
              ASSERT_EQ(to.rank, s) << "R " << ranks << " t_max " << t_max << " K " << k;
              ASSERT_EQ(to.slot, t * k + j) << "R " << ranks << " t_max " << t_max << " K " << k;
            }
          }
        }
      }
    }
  }
  // The largest places a layer allows (R * t_max * K <= INT32_MAX, EpGroup's check).
  const uint32_t t_max = 8192, k = 16, s = 63, t = t_max - 1, j = k - 1;
  const ReturnSlot to = return_slot((s * t_max + t) * k + j, k, t_max);
  EXPECT_EQ(to.rank, s);
  EXPECT_EQ(to.slot, t * k + j);
}

// The regions are aligned, in order, disjoint, and as large as their shapes.
TEST(EpProtocol, WindowRegionsAreAlignedAndDisjoint) {
  const WindowLayout l = WindowLayout::make(8, 512, 7168, 8);
  const std::vector<std::pair<int64_t, int64_t>> regions = {
      {l.local, static_cast<int64_t>(sizeof(EpLocal))},
      {l.dispatch_sig, 8 * 8},
      {l.rows_sig, 8 * 8},
      {l.return_sig, 8 * 8},
      {l.recv_flag, 8 * 512 * 8},
      {l.recv_idx, 8 * 512 * 8 * 4},
      {l.recv_w, 8 * 512 * 8 * 4},
      {l.recv_sf, 8 * 512 * (7168 / 32)},
      {l.recv_xq, 8 * 512 * 7168},
      {l.combine, 512 * 8 * 7168 * 2}};
  int64_t end = 0;
  for (const auto& [offset, bytes] : regions) {
    EXPECT_EQ(offset % kWindowAlign, 0) << offset;
    EXPECT_GE(offset, end) << "regions overlap";
    end = offset + bytes;
  }
  EXPECT_GE(l.bytes, end);
}

}  // namespace
}  // namespace megamoe::ep
