// The persistent GEMMs' tile schedule (kernels/sm90/sm90_tile_schedule.hpp) on the host: every
// tile enumerated once, and the MegaMoE work list's slots and counter protocol
// (docs/design.md, "The MegaMoE kernel"): an L2 tile waits until every L1 tile of its expert's
// n-tile is done; a simulation of G resident CTAs shows the order never deadlocks and never lets
// an L2 tile start early.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "sm90/sm90_tile_schedule.hpp"

namespace megamoe::sm90 {
namespace {

constexpr int kBlockN = 192;
constexpr int kMBlocksPerCta = 2;  // 128 weight rows per tile
using Sched = TileScheduler<kBlockN, kMBlocksPerCta>;
using Mega = MegaSchedule<kBlockN, kMBlocksPerCta>;

// Row offsets of `experts` experts with rows drawn to cover empty experts, partial n-tiles and
// several n-tiles per expert.
std::vector<int32_t> random_offsets(int experts, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> off(static_cast<size_t>(experts) + 1, 0);
  for (int e = 0; e < experts; ++e) {
    const uint32_t kind = rng() % 4;
    const int rows = kind == 0 ? 0 : kind == 1 ? static_cast<int>(1 + rng() % kBlockN)
                                               : static_cast<int>(rng() % (4 * kBlockN));
    off[static_cast<size_t>(e) + 1] = off[static_cast<size_t>(e)] + rows;
  }
  return off;
}

struct Problem {
  std::vector<int32_t> offsets, prefix1, prefix2;
  int experts = 0, m_blocks1 = 0, m_blocks2 = 0;
  Mega mega() const {
    const int mt1 = (m_blocks1 + kMBlocksPerCta - 1) / kMBlocksPerCta;
    const int mt2 = (m_blocks2 + kMBlocksPerCta - 1) / kMBlocksPerCta;
    return Mega{Sched{offsets.data(), prefix1.data(), experts, m_blocks1, mt1},
                Sched{offsets.data(), prefix2.data(), experts, m_blocks2, mt2}};
  }
};

// m_blocks: 64-row weight blocks of L1 (2I / 64) and of L2 (H / 64); odd counts leave a partial
// last m-tile.
Problem make_problem(int experts, int m_blocks1, int m_blocks2, uint32_t seed) {
  Problem p;
  p.experts = experts;
  p.m_blocks1 = m_blocks1;
  p.m_blocks2 = m_blocks2;
  p.offsets = random_offsets(experts, seed);
  p.prefix1.resize(static_cast<size_t>(experts) + 1);
  p.prefix2.resize(static_cast<size_t>(experts) + 1);
  const int mt1 = (m_blocks1 + kMBlocksPerCta - 1) / kMBlocksPerCta;
  const int mt2 = (m_blocks2 + kMBlocksPerCta - 1) / kMBlocksPerCta;
  tile_prefix<kBlockN>(p.offsets.data(), experts, mt1, p.prefix1.data());
  tile_prefix<kBlockN>(p.offsets.data(), experts, mt2, p.prefix2.data());
  return p;
}

TEST(TileSchedule, EveryWeightBlockAndRowPairOnce) {
  for (uint32_t seed = 1; seed <= 20; ++seed) {
    const Problem p = make_problem(1 + static_cast<int>(seed % 37), 7, 6, seed);
    const Sched s = p.mega().l1;
    const int rows = p.offsets.back();
    std::vector<int> hits(static_cast<size_t>(rows) * p.m_blocks1, 0);
    int prev_expert = 0;
    for (int t = 0; t < s.total_tiles(); ++t) {
      const TileInfo ti = s.get(t);
      ASSERT_GE(ti.expert, prev_expert) << "expert-major order";
      prev_expert = ti.expert;
      ASSERT_GE(ti.num_rows, 1);
      ASSERT_LE(ti.num_rows, kBlockN);
      ASSERT_GE(ti.num_m_blocks, 1);
      ASSERT_GE(ti.row0, p.offsets[ti.expert]);
      ASSERT_LE(ti.row0 + ti.num_rows, p.offsets[ti.expert + 1]);
      for (int m = ti.m_block0; m < ti.m_block0 + ti.num_m_blocks; ++m)
        for (int r = ti.row0; r < ti.row0 + ti.num_rows; ++r) ++hits[static_cast<size_t>(r) * p.m_blocks1 + m];
    }
    for (int h : hits) ASSERT_EQ(h, 1) << "seed " << seed;
  }
}

TEST(MegaSchedule, EachSlotHoldsOneExpertNTileOfBothGemms) {
  for (uint32_t seed = 1; seed <= 20; ++seed) {
    const Problem p = make_problem(1 + static_cast<int>(seed % 29), 5 + static_cast<int>(seed % 4), 3, seed);
    const Mega m = p.mega();
    const int slots = m.num_slots();
    EXPECT_LE(slots, max_schedule_slots(p.offsets.back(), p.experts, kBlockN));
    std::vector<int> l1(static_cast<size_t>(slots), 0), l2(static_cast<size_t>(slots), 0);
    std::vector<TileInfo> rows_of(static_cast<size_t>(slots), TileInfo{-1, 0, 0, 0, 0});
    for (int t = 0; t < m.total_tiles(); ++t) {
      const TileInfo ti = m.get(t);
      const int s = m.slot(ti);
      ASSERT_GE(s, 0);
      ASSERT_LT(s, slots);
      (m.is_l1(t) ? l1 : l2)[static_cast<size_t>(s)]++;
      TileInfo& r = rows_of[static_cast<size_t>(s)];
      if (r.expert < 0) r = ti;
      EXPECT_EQ(ti.expert, r.expert);
      EXPECT_EQ(ti.row0, r.row0);
      EXPECT_EQ(ti.num_rows, r.num_rows);
    }
    for (int s = 0; s < slots; ++s) {
      EXPECT_EQ(l1[static_cast<size_t>(s)], m.ready_target()) << "slot " << s;
      EXPECT_EQ(l2[static_cast<size_t>(s)], m.l2.m_tiles) << "slot " << s;
    }
  }
}

// The counter protocol run by `grid` resident CTAs, each taking tiles in `order` (static:
// CTA b takes order[b], order[b + grid], ...; claimed: each free CTA takes the next one). A tile
// takes a random number of steps; an L2 tile starts only when its slot's counter has reached
// the target (its CTA waits meanwhile); an L1 tile adds one to its slot when it ends. Returns
// false on a deadlock (every unfinished CTA waiting). Checks, against a count kept by each
// tile's own rows (expert, first row) rather than by slot, that an L2 tile starts only after
// every L1 tile over its rows has ended, and that every counter ends at exactly the target.
bool simulate(const Mega& m, const std::vector<int>& order, int grid, bool claimed, uint32_t seed) {
  std::mt19937 rng(seed);
  const int n = static_cast<int>(order.size());
  std::vector<int> ready(static_cast<size_t>(m.num_slots()), 0);
  const int first_row_end = m.l1.offsets[m.l1.num_experts];
  std::vector<int> l1_over_rows(static_cast<size_t>(first_row_end) + 1, 0), l1_ended(l1_over_rows.size(), 0);
  for (int t = 0; t < m.l1_tiles(); ++t) ++l1_over_rows[static_cast<size_t>(m.get(t).row0)];
  struct Cta { int next = 0, tile = -1, left = 0; };  // next: position in its own list (static)
  std::vector<Cta> ctas(static_cast<size_t>(grid));
  int claimed_upto = 0, done = 0;
  auto take = [&](Cta& c, int b) -> int {
    if (claimed) return claimed_upto < n ? order[static_cast<size_t>(claimed_upto++)] : -1;
    const int pos = b + c.next * grid;
    return pos < n ? (++c.next, order[static_cast<size_t>(pos)]) : -1;
  };
  while (done < n) {
    bool progress = false;
    for (int b = 0; b < grid; ++b) {
      Cta& c = ctas[static_cast<size_t>(b)];
      if (c.tile < 0) {
        c.tile = take(c, b);
        if (c.tile < 0) continue;
        c.left = -1;  // not started
        progress = true;
      }
      const TileInfo ti = m.get(c.tile);
      const size_t s = static_cast<size_t>(m.slot(ti));
      const size_t r = static_cast<size_t>(ti.row0);
      if (c.left < 0) {  // start: an L2 tile waits for its slot
        if (!m.is_l1(c.tile) && ready[s] < m.ready_target()) continue;
        if (!m.is_l1(c.tile)) {
          EXPECT_EQ(l1_ended[r], l1_over_rows[r]) << "L2 tile " << c.tile << " started early";
        }
        c.left = 1 + static_cast<int>(rng() % 5);
      }
      progress = true;
      if (--c.left == 0) {
        if (m.is_l1(c.tile)) {
          ++ready[s];
          ++l1_ended[r];
        }
        c.tile = -1;
        ++done;
      }
    }
    if (!progress) return false;
  }
  for (size_t s = 0; s < ready.size(); ++s) EXPECT_EQ(ready[s], m.ready_target()) << "slot " << s;
  return true;
}

TEST(MegaSchedule, ProtocolCompletesUnderEveryGrid) {
  for (uint32_t seed = 1; seed <= 12; ++seed) {
    const Problem p = make_problem(3 + static_cast<int>(seed % 17), 6, 5, seed);
    const Mega m = p.mega();
    std::vector<int> order(static_cast<size_t>(m.total_tiles()));
    for (int t = 0; t < m.total_tiles(); ++t) order[static_cast<size_t>(t)] = t;
    for (int grid : {1, 2, 3, 7, 132, 1000}) {
      for (bool claimed : {false, true}) {
        EXPECT_TRUE(simulate(m, order, grid, claimed, seed * 31 + static_cast<uint32_t>(grid)))
            << "seed " << seed << " grid " << grid << (claimed ? " claimed" : " static");
      }
    }
  }
}

// The simulation can fail: L2's tiles ahead of L1's on one CTA wait for tiles behind them.
TEST(MegaSchedule, SimulationCatchesAnOrderThatDeadlocks) {
  const Problem p = make_problem(4, 4, 4, 3);
  const Mega m = p.mega();
  ASSERT_GT(m.l1_tiles(), 0);
  std::vector<int> order(static_cast<size_t>(m.total_tiles()));
  for (int t = 0; t < m.total_tiles(); ++t) order[static_cast<size_t>(t)] = m.total_tiles() - 1 - t;
  EXPECT_FALSE(simulate(m, order, 1, false, 1));
}

}  // namespace
}  // namespace megamoe::sm90
