#!/usr/bin/env python3
"""Writes, for build_marlin.sh, the Marlin MoE kernel instantiations the peer needs and the
`kernel_selector.h` that vLLM's csrc/moe/marlin_moe_wna16/ops.cu includes inside
get_marlin_kernel(): only BF16 activations x float4_e2m1f weights x BF16 output with
float8_e8m0fnu scales per group of 32 (MXFP4, W4A16), i.e. group_blocks = 2.

The tile set follows the one vLLM builds for that type combination (thread tiles (k, n, threads)
(128,128,256), (64,256,256), (64,128,128), (128,64,128); thread_m_blocks 0.5 (= an 8-row moe block),
1, 2, 3, 4; 256-thread tiles only (128,128) for m <= 1 and (64,256) for m > 1; 4 pipeline stages),
so marlin_mm's own tile choice finds every kernel it may ask for.

    gen_instances.py OUT_DIR     -> OUT_DIR/kernel_selector.h, OUT_DIR/kernels_m{8,16,32,48,64}.cu
"""
import os
import sys

THREAD_TILES = [(128, 128, 256), (64, 256, 256), (64, 128, 128), (128, 64, 128)]
M_BLOCKS = [0.5, 1, 2, 3, 4]
GROUP_BLOCKS = 2          # group size 32 = 2 x 16
STAGES = 4
TYPES = dict(a='vllm::kBFloat16', b='vllm::kFE2M1f', c='vllm::kBFloat16', s='vllm::kFE8M0fnu')


def configs():
    for m in M_BLOCKS:
        for k, n, threads in THREAD_TILES:
            if threads == 256 and (k, n) != ((128, 128) if m <= 1 else (64, 256)):
                continue
            yield dict(threads=threads, m=max(int(m), 1), n=n // 16, k=k // 16,
                       m8='true' if m == 0.5 else 'false', rows=int(m * 16))


def template_args(c):
    t = TYPES
    return (f"{t['a']}.id(), {t['b']}.id(), {t['c']}.id(), {t['s']}.id(), {c['threads']}, {c['m']}, "
            f"{c['n']}, {c['k']}, {c['m8']}, {STAGES}, {GROUP_BLOCKS}, false")


def main(out: str) -> int:
    os.makedirs(out, exist_ok=True)
    head = '// written by bench/peers/marlin_shim/gen_instances.py (megamoe), do not edit\n'
    sel = [head]
    per_rows = {}
    for i, c in enumerate(configs()):
        t = TYPES
        cond = ' && '.join([f"a_type == {t['a']}", f"b_type == {t['b']}", f"c_type == {t['c']}",
                            f"s_type == {t['s']}", f"threads == {c['threads']}",
                            f"thread_m_blocks == {c['m']}", f"thread_n_blocks == {c['n']}",
                            f"thread_k_blocks == {c['k']}", f"m_block_size_8 == {c['m8']}",
                            f"stages == {STAGES}", f"group_blocks == {GROUP_BLOCKS}", 'is_zp_float == false'])
        sel.append(f"{'if' if i == 0 else 'else if'} ({cond})\n  kernel = Marlin<{template_args(c)}>;\n")
        per_rows.setdefault(c['rows'], []).append(c)
    with open(os.path.join(out, 'kernel_selector.h'), 'w') as f:
        f.write(''.join(sel))
    for rows, cs in per_rows.items():
        body = ''.join(f'template __global__ void Marlin<{template_args(c)}>(MARLIN_KERNEL_PARAMS);\n\n' for c in cs)
        with open(os.path.join(out, f'kernels_m{rows}.cu'), 'w') as f:
            f.write(head + '#include "kernel.h"\n#include "marlin_template.h"\n\n'
                    'namespace MARLIN_NAMESPACE_NAME {\n\n' + body + '}  // namespace MARLIN_NAMESPACE_NAME\n')
    print(f'{sum(len(v) for v in per_rows.values())} kernels in {len(per_rows)} files under {out}')
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1]))
