// sm90_diag.hpp: every compile-time diagnostic switch of the Hopper GEMM, with its default. Each
// is set only by hand, as a -D flag of a measurement build (the build files never set one); 0 is
// the shipped code. Except for the timeline, a build that sets one computes wrong results: the
// GEMM benchmark then times a part of the kernel alone (docs/perf.md, "How it is measured").
#pragma once

// 1: the grouped GEMM stamps %globaltimer at fixed points of every CTA's life, read back with
// sm90::diag_read_timeline (sm90_diag_timeline.cuh); results stay right.
#ifndef MEGAMOE_DIAG_TIMELINE
#define MEGAMOE_DIAG_TIMELINE 0
#endif

// 1: the overlapped mainloop copies the loaded words instead of converting them (wgmmas, loads
// and barriers stay); 2: only the barrier waits and arrivals stay, the copies still stream.
#ifndef MEGAMOE_DIAG_MAINLOOP
#define MEGAMOE_DIAG_MAINLOOP 0
#endif

// 1: the split-K hand-off (split_k_reduce) is skipped, so split launches time the K parts alone.
#ifndef MEGAMOE_DIAG_SPLIT_FREE
#define MEGAMOE_DIAG_SPLIT_FREE 0
#endif

// 1: the asynchronous epilogue's warps skip finishing each staged block (they still wait for it
// and hand the staging area back), so async launches time the mainloop and the staging alone.
#ifndef MEGAMOE_DIAG_EPILOGUE_FREE
#define MEGAMOE_DIAG_EPILOGUE_FREE 0
#endif

// 1: every mbarrier wait (ptx/sm90_ptx.cuh) and the MegaMoE kernel's counter waits print who
// waits where once they have waited ~1 s, before the deadline's trap: a stall diagnosis (tuning
// log v24). Results stay right; the printf makes ptxas serialize the wgmma kernels' MMAs. Read
// where it is used as `defined(...) && ...` (the PTX header does not include this one).
