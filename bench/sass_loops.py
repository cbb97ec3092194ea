#!/usr/bin/env python3
"""The loop around a kernel's first instruction matching PATTERN, per function of a SASS listing:
its instruction count and the most frequent opcodes (a static look at a mainloop's cost, e.g.
the fused kernel's against the chained GEMM's; docs/tuning-log.md v32).

    nvcc ... -cubin build/sm90_gemm_tiles/sm90_mega_tile_8.cu -o t.cubin   # the build's flags
    nvdisasm t.cubin > t.sass        # nvdisasm: the CUDA toolkit, or the nvidia-cuda-nvdisasm wheel
    python3 bench/sass_loops.py t.sass HGMMA.64x192x16

The loop is the first backward branch after the match whose target lies at or before it.
"""
import re
import sys


def functions(path):
    funcs, cur, pending = [], None, []
    for line in open(path):
        m = re.match(r'^\.text\.(\S+):', line)
        if m:
            cur = [m.group(1), [], {}]
            funcs.append(cur)
            continue
        m = re.match(r'^(\.L_x_\d+):', line)
        if m:
            pending.append(m.group(1))
            continue
        m = re.match(r'\s*/\*([0-9a-f]{4,})\*/\s+(.*?);', line)
        if m and cur:
            addr = int(m.group(1), 16)
            cur[1].append((addr, m.group(2).strip()))
            for label in pending:
                cur[2][label] = addr
            pending = []
    return funcs


def main(path, pattern):
    for name, ins, labels in functions(path):
        hits = [i for i, (_, text) in enumerate(ins) if pattern in text]
        if not hits:
            continue
        start = ins[hits[0]][0]
        loop = None
        for addr, text in ins[hits[0]:]:
            m = re.search(r'\bBRA\b.*?(\.L_x_\d+)', text)
            if m and labels.get(m.group(1), 1 << 62) <= start:
                loop = (labels[m.group(1)], addr)
                break
        if loop is None:
            continue
        body = [text for addr, text in ins if loop[0] <= addr <= loop[1]]
        ops = {}
        for text in body:
            toks = text.split()
            op = (toks[1] if toks[0].startswith('@') else toks[0]).split('.')[0]
            ops[op] = ops.get(op, 0) + 1
        top = ', '.join(f'{k} {v}' for k, v in sorted(ops.items(), key=lambda x: -x[1])[:12])
        matched = sum(pattern in t for t in body)
        print(f'{name[-60:]}: loop {loop[0]:#x}-{loop[1]:#x}, {len(body)} instructions, '
              f'{matched} x {pattern}; {top}')


if __name__ == '__main__':
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
