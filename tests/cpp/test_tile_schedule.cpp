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
      // slot_info (the FP8 rebase units' rows) inverts slot().
      const TileInfo si = m.slot_info(s), &r = rows_of[static_cast<size_t>(s)];
      EXPECT_EQ(si.expert, r.expert) << "slot " << s;
      EXPECT_EQ(si.row0, r.row0) << "slot " << s;
      EXPECT_EQ(si.num_rows, r.num_rows) << "slot " << s;
      EXPECT_EQ(m.slot(si), s);
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

// The fused kernel's protocol as sm90_mega_moe.cuh runs it, step by step: units (L1 tile t's K
// parts t s1 + sp, then L2 tile t's parts U1 + t s2 + sp); per CTA a producer that takes units
// from the counter (every unit, or with `fixed_first` unit b first as a static split would),
// an L2 unit's producer that waits for its slot's ready count, adds one to the slot's consumed
// count past the wait and, as the slot's last L2 unit, zeroes both; a producer that runs at most
// one unit ahead of its math (the pipeline); a math that ends each unit after a few steps, an L1
// tile's last part adding one to its slot's ready count. At most `resident` CTAs run at once (the
// others start as running ones exit: SMs shared with other kernels); `launches` launches run at
// once on the same counters (the layer runs one). FP8 mode (`rebase` > 0): between L1's and L2's
// units, `rebase` rebase units per slot, whose producer waits for the slot's L1 tiles and whose
// math adds one to the slot's ready count; L2 units then wait for L1's m-tiles plus the rebase
// units (`l2_skips_rebase`: only for L1's, the bug the check must catch). The dispatch inside
// (`gather` > 0): ahead of every L1 unit, `gather` gather units per slot, whose math ends only
// once the slot's rows have arrived (a random step: other ranks' sends) and adds one to the
// slot's ready count; L1 units wait for the gather units, and every later target adds them
// (`l1_skips_gather`: L1 tiles that do not wait, the bug the check must catch). The outcome: a
// deadlock, a unit past its wait before every unit it reads has ended, counters not all zero at
// the end, or none.
struct KernelRun {
  int s1 = 1, s2 = 1, grid = 8, resident = 8, launches = 1;
  bool fixed_first = false;
  int rebase = 0;
  bool l2_skips_rebase = false;
  int gather = 0;
  bool l1_skips_gather = false;
  // The combine inside (MegaCombine), every CTA's last unit: it counts the CTA out; then
  // kEveryCta: the last `summers` CTAs out, kLastCta: the last one out of its launch, wait until
  // every CTA of every launch is out (one GPU: its own launch; virtual ranks: every rank's
  // return_sig) and sum. `combine_skips_wait`: the summers do not wait (the bug the check must
  // catch).
  enum class Combine { kNone, kEveryCta, kLastCta } combine = Combine::kNone;
  int summers = 1;
  bool combine_skips_wait = false;
  bool shared_counters = true;  // several launches: one set of slot counters (false: one each)
};
enum class Outcome { kOk, kDeadlock, kEarlyPass, kCountersLeftSet };
Outcome simulate_kernel(const Mega& m, const KernelRun& k, uint32_t seed) {
  std::mt19937 rng(seed);
  const int slots = m.num_slots();
  const int g_units = slots * k.gather;  // gather units, then L1's [g_units, u1)
  const int u1 = g_units + m.l1_tiles() * k.s1;
  const int l2_first = u1 + slots * k.rebase;
  const int units = l2_first + m.l2.total_tiles() * k.s2;
  const int l1_target = k.l1_skips_gather ? 0 : k.gather;
  const int rebase_target = k.gather + m.ready_target();
  const int l2_target = rebase_target + (k.l2_skips_rebase ? 0 : k.rebase);
  // The slot counters: one set for every launch (shared_counters: the bug of two launches on
  // one workspace), or one per launch (virtual ranks, each with its own workspace).
  std::vector<std::vector<int>> ready_of(k.shared_counters ? 1 : static_cast<size_t>(k.launches),
                                         std::vector<int>(static_cast<size_t>(slots), 0));
  std::vector<std::vector<int>> consumed_of = ready_of;
  struct Launch {
    int counter = 0, exited = 0;
    // per L1 tile; per slot (for the checks): units ended, the step its rows arrive
    std::vector<int> parts_arrived, l1_ended, rebase_ended, gather_ended, rows_arrive;
    int l2_ended = 0, out = 0;  // L2 units ended; CTAs counted out by the combine
  };
  std::vector<Launch> launches(static_cast<size_t>(k.launches));
  for (Launch& l : launches) {
    l.parts_arrived.assign(static_cast<size_t>(m.l1_tiles()), 0);
    l.l1_ended.assign(static_cast<size_t>(slots), 0);
    l.rebase_ended.assign(static_cast<size_t>(slots), 0);
    l.gather_ended.assign(static_cast<size_t>(slots), 0);
    l.rows_arrive.assign(static_cast<size_t>(slots), 0);
    for (int& a : l.rows_arrive) a = static_cast<int>(rng() % 60);
  }
  struct Cta {
    int launch = 0, b = 0;
    bool started = false, exited = false, producer_done = false, first_taken = false;
    bool counted_out = false, sums = false;  // the combine
    int produced = -1;  // unit the producer holds (-1 none); waiting on its slot if L2
    bool passed = false;  // that unit's L2 wait passed
    std::vector<int> queue;  // units handed to the math, in order
    int left = 0;            // steps left of queue.front()
  };
  std::vector<Cta> ctas;
  for (int l = 0; l < k.launches; ++l)
    for (int b = 0; b < k.grid; ++b) ctas.push_back(Cta{l, b});
  // CTAs start in a random order, at most `resident` at once.
  std::vector<size_t> start_order(ctas.size());
  for (size_t i = 0; i < ctas.size(); ++i) start_order[i] = i;
  std::shuffle(start_order.begin(), start_order.end(), rng);
  size_t next_start = 0;
  int running = 0;
  auto is_gather = [&](int u) { return u < g_units; };
  auto is_l1 = [&](int u) { return u >= g_units && u < u1; };
  auto is_rebase = [&](int u) { return u >= u1 && u < l2_first; };
  auto slot_of = [&](int u) {
    if (is_gather(u)) return u / k.gather;
    if (is_rebase(u)) return (u - u1) / k.rebase;
    return m.slot(m.get(is_l1(u) ? (u - g_units) / k.s1 : (u - l2_first) / k.s2 + m.l1_tiles()));
  };
  auto take = [&](Cta& c) {
    Launch& l = launches[static_cast<size_t>(c.launch)];
    if (k.fixed_first && !c.first_taken) {
      c.first_taken = true;
      return c.b < units ? c.b : units;
    }
    const int u = (k.fixed_first ? k.grid : 0) + l.counter++;
    return u < units ? u : units;
  };
  int finished_launches = 0;
  bool early = false;
  for (int step = 0; finished_launches < k.launches; ++step) {
    bool progress = false;
    while (running < k.resident && next_start < start_order.size()) {
      ctas[start_order[next_start++]].started = true;
      ++running;
      progress = true;
    }
    for (Cta& c : ctas) {
      if (!c.started || c.exited) continue;
      Launch& l = launches[static_cast<size_t>(c.launch)];
      std::vector<int>& ready = ready_of[k.shared_counters ? 0 : static_cast<size_t>(c.launch)];
      std::vector<int>& consumed = consumed_of[k.shared_counters ? 0 : static_cast<size_t>(c.launch)];
      // producer
      if (!c.producer_done && c.queue.size() < 2) {
        if (c.produced < 0) {
          c.produced = take(c);
          c.passed = false;
          progress = true;
        }
        if (c.produced >= units) {
          c.producer_done = true;
        } else if (is_gather(c.produced)) {
          c.queue.push_back(c.produced);
          c.produced = -1;
        } else if (is_l1(c.produced)) {
          const size_t s = static_cast<size_t>(slot_of(c.produced));
          if (ready[s] >= l1_target) {
            if (l.gather_ended[s] != k.gather) early = true;
            c.passed = true;
            progress = true;
          }
        } else if (is_rebase(c.produced)) {
          const size_t s = static_cast<size_t>(slot_of(c.produced));
          if (ready[s] >= rebase_target) {
            if (l.l1_ended[s] != m.ready_target()) early = true;
            c.passed = true;
            progress = true;
          }
        } else if (!c.passed) {
          const size_t s = static_cast<size_t>(slot_of(c.produced));
          if (ready[s] >= l2_target) {
            if (l.l1_ended[s] != m.ready_target() || l.rebase_ended[s] != k.rebase ||
                l.gather_ended[s] != k.gather) {
              early = true;
            }
            c.passed = true;
            progress = true;
            if (++consumed[s] == m.l2.m_tiles * k.s2) ready[s] = consumed[s] = 0;
          }
        }
        if (c.passed) {
          c.queue.push_back(c.produced);
          c.produced = -1;
        }
      }
      // math (a gather unit's rows arrive at their step: until then it waits)
      const bool rows_missing =
          !c.queue.empty() && is_gather(c.queue.front()) &&
          step < l.rows_arrive[static_cast<size_t>(slot_of(c.queue.front()))];
      if (rows_missing) progress = true;  // the other ranks' sends go on
      if (!c.queue.empty() && !rows_missing) {
        if (c.left == 0) c.left = 1 + static_cast<int>(rng() % 4);
        progress = true;
        if (--c.left == 0) {
          const int u = c.queue.front();
          c.queue.erase(c.queue.begin());
          if (is_gather(u)) {
            const size_t s = static_cast<size_t>(slot_of(u));
            ++ready[s];
            ++l.gather_ended[s];
          } else if (is_l1(u)) {
            const size_t t = static_cast<size_t>((u - g_units) / k.s1);
            if (++l.parts_arrived[t] == k.s1) {
              l.parts_arrived[t] = 0;
              const size_t s = static_cast<size_t>(slot_of(u));
              ++ready[s];
              ++l.l1_ended[s];
            }
          } else if (is_rebase(u)) {
            const size_t s = static_cast<size_t>(slot_of(u));
            ++ready[s];
            ++l.rebase_ended[s];
          } else {
            ++l.l2_ended;
          }
        }
      }
      if (k.combine != KernelRun::Combine::kNone && c.producer_done && c.queue.empty()) {
        if (!c.counted_out) {  // the combine unit: count out
          c.counted_out = true;
          progress = true;
          ++l.out;
          c.sums = k.combine == KernelRun::Combine::kEveryCta ? l.out > k.grid - k.summers
                                                               : l.out == k.grid;
        }
        if (c.sums) {
          bool all_out = true;
          for (const Launch& other : launches) all_out = all_out && other.out == k.grid;
          if (!all_out && !k.combine_skips_wait) continue;  // waiting (no progress)
          for (const Launch& other : launches)
            if (other.l2_ended != m.l2.total_tiles() * k.s2) early = true;
          c.sums = false;
        }
      }
      if (c.producer_done && c.queue.empty()) {
        c.exited = true;
        --running;
        progress = true;
        if (++l.exited == k.grid) ++finished_launches;
      }
    }
    if (!progress) return Outcome::kDeadlock;
  }
  if (early) return Outcome::kEarlyPass;
  for (size_t i = 0; i < ready_of.size(); ++i) {
    for (size_t s = 0; s < ready_of[i].size(); ++s) {
      if (ready_of[i][s] != 0 || consumed_of[i][s] != 0) return Outcome::kCountersLeftSet;
    }
  }
  return Outcome::kOk;
}

TEST(MegaSchedule, KernelProtocolCompletesWithPartsAndFewResidentCtas) {
  for (uint32_t seed = 1; seed <= 10; ++seed) {
    const Problem p = make_problem(3 + static_cast<int>(seed % 11), 6, 5, seed);
    const Mega m = p.mega();
    for (const KernelRun& k : {KernelRun{1, 1, 8, 8}, KernelRun{2, 1, 8, 8}, KernelRun{1, 3, 16, 5},
                               KernelRun{4, 2, 132, 40}, KernelRun{3, 4, 64, 1}, KernelRun{2, 2, 32, 7}}) {
      EXPECT_EQ(simulate_kernel(m, k, seed * 17 + static_cast<uint32_t>(k.grid)), Outcome::kOk)
          << "seed " << seed << " parts " << k.s1 << "/" << k.s2 << " grid " << k.grid
          << " resident " << k.resident;
    }
  }
}

// The FP8 mode's rebase units between L1's and L2's units (3 per slot as fp8_128x192, 2 as the
// staged FP8 tile), with few resident CTAs: no deadlock, no L2 tile before its slot's rows are
// rebased, counters zero; and an L2 wait that ignored the rebase units is caught.
TEST(MegaSchedule, KernelProtocolWithRebaseUnitsCompletesAndCatchesAnEarlyL2) {
  int caught = 0;
  for (uint32_t seed = 1; seed <= 10; ++seed) {
    const Problem p = make_problem(3 + static_cast<int>(seed % 11), 6, 5, seed);
    const Mega m = p.mega();
    for (KernelRun k : {KernelRun{1, 1, 8, 8}, KernelRun{1, 1, 16, 3}, KernelRun{1, 1, 132, 40},
                        KernelRun{1, 1, 64, 1}}) {
      for (int rebase : {2, 3}) {
        k.rebase = rebase;
        EXPECT_EQ(simulate_kernel(m, k, seed * 31 + static_cast<uint32_t>(k.grid + rebase)), Outcome::kOk)
            << "seed " << seed << " grid " << k.grid << " resident " << k.resident << " rebase " << rebase;
        k.l2_skips_rebase = true;
        caught += simulate_kernel(m, k, seed * 31 + static_cast<uint32_t>(k.grid)) == Outcome::kEarlyPass;
        k.l2_skips_rebase = false;
      }
    }
  }
  EXPECT_GT(caught, 0) << "an L2 wait that skips the rebase units never passed early";
}

// The dispatch inside the launch (expert parallelism): gather units per slot (2 as the 128-row
// tiles, 3 as the 192-row ones) ahead of every L1 unit, their rows arriving at random steps,
// with split parts, FP8 rebase units and few resident CTAs: no deadlock, no L1 tile before its
// slot's rows are gathered, counters zero; and L1 tiles that skip the wait are caught.
TEST(MegaSchedule, KernelProtocolWithGatherUnitsCompletesAndCatchesAnEarlyL1) {
  int caught = 0;
  for (uint32_t seed = 1; seed <= 10; ++seed) {
    const Problem p = make_problem(3 + static_cast<int>(seed % 11), 6, 5, seed);
    const Mega m = p.mega();
    for (KernelRun k : {KernelRun{1, 1, 8, 8}, KernelRun{2, 3, 16, 3}, KernelRun{1, 1, 132, 40},
                        KernelRun{1, 1, 64, 1}}) {
      for (int gather : {1, 2, 3}) {
        k.gather = gather;
        k.rebase = gather == 3 ? 3 : 0;
        const uint32_t run_seed = seed * 37 + static_cast<uint32_t>(k.grid + gather);
        EXPECT_EQ(simulate_kernel(m, k, run_seed), Outcome::kOk)
            << "seed " << seed << " grid " << k.grid << " resident " << k.resident << " gather "
            << gather;
        k.l1_skips_gather = true;
        caught += simulate_kernel(m, k, run_seed) == Outcome::kEarlyPass;
        k.l1_skips_gather = false;
      }
    }
  }
  EXPECT_GT(caught, 0) << "an L1 wait that skips the gather units never passed early";
}

// The two hazards the kernel's rules avoid: a first unit fixed per CTA (as the decode GEMMs' static
// first unit) deadlocks when not every CTA can be resident at once, and two launches at once on one
// workspace's counters fail (an early pass, a deadlock or counters left set).
// The combine inside the launch: every CTA's last unit counts it out, and the last CTAs out sum
// after waiting for every CTA (of every launch: virtual ranks wait for each other's returns).
// Fewer summers than resident CTAs complete whatever the residency (kMegaCombineCtas < the SMs);
// every CTA summing completes only with the whole grid resident at once; the last CTA alone
// completes with few resident CTAs and several launches; a summer that does not wait is caught
// reading L2 rows not yet written.
TEST(MegaSchedule, KernelProtocolWithTheCombineNeedsTheGridResidentOrTheLastCta) {
  using C = KernelRun::Combine;
  int caught = 0;
  for (uint32_t seed = 1; seed <= 10; ++seed) {
    const Problem p = make_problem(3 + static_cast<int>(seed % 11), 6, 5, seed);
    const Mega m = p.mega();
    auto run = [&](KernelRun k) { return simulate_kernel(m, k, seed * 41 + static_cast<uint32_t>(k.grid)); };
    for (KernelRun k : {KernelRun{1, 1, 8, 8}, KernelRun{2, 3, 16, 16}, KernelRun{1, 1, 132, 132}}) {
      for (int summers : {1, 3, k.grid}) {
        k.combine = C::kEveryCta;
        k.summers = summers;
        EXPECT_EQ(run(k), Outcome::kOk) << "seed " << seed << " grid " << k.grid << " summers " << summers;
        k.combine_skips_wait = true;
        caught += run(k) == Outcome::kEarlyPass;
        k.combine_skips_wait = false;
      }
      k.combine = C::kLastCta;
      EXPECT_EQ(run(k), Outcome::kOk) << "seed " << seed << " grid " << k.grid;
    }
    // Four virtual ranks' launches sharing 5 resident CTAs: the last CTA of each alone waits.
    KernelRun ranks{1, 1, 8, 5, 4};
    ranks.shared_counters = false;
    ranks.combine = C::kLastCta;
    EXPECT_EQ(run(ranks), Outcome::kOk) << "seed " << seed;
    // More CTAs than fit at once: fewer summers than resident CTAs complete; every CTA waiting
    // does not, in one launch or in several ranks' launches.
    KernelRun fewer{1, 1, 16, 12};
    fewer.combine = C::kEveryCta;
    fewer.summers = 11;
    EXPECT_EQ(run(fewer), Outcome::kOk) << "seed " << seed;
    KernelRun over{1, 1, 16, 12};
    over.combine = C::kEveryCta;
    over.summers = 16;
    EXPECT_EQ(run(over), Outcome::kDeadlock) << "seed " << seed;
    ranks.combine = C::kEveryCta;
    ranks.summers = 8;
    EXPECT_EQ(run(ranks), Outcome::kDeadlock) << "seed " << seed;
  }
  EXPECT_GT(caught, 0) << "a summer that skips the wait was never caught";
}

TEST(MegaSchedule, KernelProtocolFailsWithFixedFirstUnitsOrSharedCounters) {
  const Problem p = make_problem(6, 6, 5, 5);
  const Mega m = p.mega();
  ASSERT_GT(m.l1_tiles(), 8);
  KernelRun fixed{1, 1, 8, 4};
  fixed.fixed_first = true;
  EXPECT_EQ(simulate_kernel(m, fixed, 1), Outcome::kDeadlock)
      << "fixed first units with half the CTAs resident";
  int failed = 0;
  for (uint32_t seed = 1; seed <= 20; ++seed) {
    KernelRun two{1, 1, 8, 16};
    two.launches = 2;
    failed += simulate_kernel(m, two, seed) != Outcome::kOk;
  }
  EXPECT_GT(failed, 0) << "two launches on one set of counters never failed in 20 runs";
}

}  // namespace
}  // namespace megamoe::sm90
