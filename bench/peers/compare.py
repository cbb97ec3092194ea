#!/usr/bin/env python3
"""megamoe against its peers on one GPU, in one run (issue 5; targets.md, "Peers" and protocol).

    python3 bench/peers/compare.py --megamoe-bin build/megamoe --out results/

1. re-measures the ceilings (copy, BF16 and FP8 GEMM) in this run;
2. runs `<megamoe-bin> bench --json <--megamoe-args>` and keeps its JSON lines (missing binary or a
   failing bench is recorded as such; the peers still run);
3. runs each peer on each shape in its own child process with a time limit (worker.py): same seeds,
   so every peer sees the same weights, x and routing; each point is checked against the torch
   contract reference (reference.py) before it is timed;
4. writes <out>/peers.jsonl (every record, the environment first), <out>/table.md and
   <out>/peers.png (time vs tokens, log-log, one line per system, the floor drawn), and prints the
   table: median and min us, effective TFLOP/s, fraction of floor, megamoe/peer time ratio, check.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import tarfile
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

from common import SHAPES, TOKEN_COUNTS, effective_tflops, floors  # noqa: E402

PEERS = ('torch-bf16', 'deepgemm-fp8', 'deepgemm-mega', 'deepgemm-mega-fp4', 'triton-mxfp4',
         'flashinfer-sm90-mxfp4', 'marlin-mxfp4-w4a16',
         'megamoe-py-fp8')   # megamoe's FP8 mode, listed beside the peers (ratio: megamoe-py / it)
MEGAMOE_PY = 'megamoe-py'      # megamoe's Python layer on the peers' exact inputs (peer_megamoe.py)
SYSTEMS = (MEGAMOE_PY,) + PEERS
JIT_PEERS = ('deepgemm-fp8', 'deepgemm-mega', 'deepgemm-mega-fp4', 'triton-mxfp4',
             'flashinfer-sm90-mxfp4')   # compile kernels on first use
DEFAULT_SHAPES = ('kimi-k3', 'deepseek-v3', 'gpt-oss-120b')
MEGAMOE = 'megamoe'
PYLIB = os.path.join(REPO, '.whl', 'pylib')       # extracted pure-Python peers (fetch_wheels.sh)
CARRIED_JIT_CACHE = os.path.join(REPO, '.whl', 'dg_jit_cache')   # DeepGEMM cubins of an earlier run
JIT_CACHE = '/tmp/megamoe_peers_dg_jit_cache'
CARRIED_TRITON_CACHE = os.path.join(REPO, '.whl', 'triton_cache')
TRITON_CACHE = '/tmp/megamoe_peers_triton_cache'
PACKED_PEERS = ('deep_gemm_vllm.tar.xz',)   # unpacked to UNPACK_ROOT/<name>/ and put on PYTHONPATH
UNPACK_ROOT = '/tmp/megamoe_peers_pylib'

# Aliases accepted in `megamoe bench --json` lines (the harness is built in parallel; see README).
KEY_ALIASES = {
    'shape': ('shape', 'shape_name'),
    'tokens': ('tokens', 'num_tokens', 'T', 't'),
    'routing': ('routing', 'routing_kind'),
    'median_us': ('median_us', 'time_us', 'us', 'median'),
    'min_us': ('min_us', 'min'),
}


def run_cmd(cmd, timeout):
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or '')
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or '')
        return 'timeout', out, err
    except OSError as exc:
        return f'oserror: {exc}', '', ''


def named_revision() -> str:
    """The revision named in REPO/REVISION (bench/gpu_session.sh's caller writes it), or ''."""
    try:
        with open(os.path.join(REPO, 'REVISION')) as f:
            return f.read().strip()
    except OSError:
        return ''


def environment() -> dict:
    env = {'system': 'environment', 'date': datetime.datetime.now(datetime.timezone.utc).isoformat()}
    rc, out, _ = run_cmd(['nvidia-smi', '--query-gpu=name,driver_version,clocks.sm,clocks.mem,'
                          'clocks.max.sm,clocks.max.mem,power.limit', '--format=csv,noheader'], 30)
    if rc == 0 and out.strip():
        keys = ('gpu', 'driver', 'clock_sm', 'clock_mem', 'clock_max_sm', 'clock_max_mem', 'power_limit')
        env.update(dict(zip(keys, [s.strip() for s in out.strip().splitlines()[0].split(',')])))
    named = named_revision()
    if named:
        # The device machine's copy of the tree may carry stale git metadata: the caller's
        # REVISION file names the revision under test.
        env['git_rev'], env['git_rev_source'], env['git_dirty'] = named, 'REVISION file', None
    else:
        rc, out, _ = run_cmd(['git', '-C', REPO, 'rev-parse', 'HEAD'], 30)
        env['git_rev'] = out.strip() if rc == 0 and out.strip() else os.environ.get('MEGAMOE_GIT_REV', 'unknown')
        rc, out, _ = run_cmd(['git', '-C', REPO, 'status', '--porcelain', '--untracked-files=no'], 30)
        env['git_dirty'] = bool(out.strip()) if rc == 0 else None
    try:
        import torch
        env['torch'] = torch.__version__
        env['cuda'] = torch.version.cuda
    except Exception as exc:
        env['torch'] = f'unavailable: {exc}'
    for mod in ('deep_gemm', 'triton', 'triton_kernels'):
        try:
            m = __import__(mod)
            env[mod] = getattr(m, '__version__', 'present')
        except Exception as exc:
            env[mod] = f'unavailable: {type(exc).__name__}: {exc}'[:200]
    return env


def _get(rec: dict, key: str):
    for k in KEY_ALIASES[key]:
        if k in rec:
            return rec[k]
    return None


def megamoe_ep_size(shape_name: str) -> int:
    sh = SHAPES[shape_name]
    return sh.num_experts // sh.bench_experts


def run_megamoe(args, shapes, tokens) -> list[dict]:
    """`megamoe bench` once per (shape, routing), appending JSON lines to <out>/megamoe_bench.jsonl.

    kimi-k3 runs with --ep-size 8 (rank 0's 112 experts). NOTES: the bench routes T tokens over all
    E experts, so rank 0 gets about T*K/8 of the slots: a lighter load than the peers' (T tokens
    routed among the 112 local experts, T*K slots). Its lines keep their own floor and are not used
    for the megamoe/peer ratio where megamoe-py (the peers' exact inputs) ran."""
    base = {'system': MEGAMOE}
    if not args.megamoe_bin or not os.path.isfile(args.megamoe_bin):
        reason = f'megamoe binary not found at {args.megamoe_bin!r}'
        print('megamoe:', reason, flush=True)
        return [{**base, 'shape': s, 'tokens': t, 'routing': 'uniform', 'status': 'missing', 'reason': reason}
                for s in shapes for t in tokens]
    json_path = os.path.join(args.out, 'megamoe_bench.jsonl')
    if os.path.exists(json_path):
        os.remove(json_path)
    routings = args.megamoe_routings.split(',')
    runs = [(s, r) for s in shapes for r in routings]
    deadline = time.time() + args.megamoe_timeout
    failures = {}
    rev = named_revision()
    with open(os.path.join(args.out, 'megamoe_bench.log'), 'w') as log:
        for n, (s, r) in enumerate(runs):
            left = deadline - time.time()
            if left <= 5:
                failures[(s, r)] = f'--megamoe-timeout {args.megamoe_timeout:.0f} s spent before this run'
                continue
            cmd = [args.megamoe_bin, 'bench', '--shape', s, '--tokens', ','.join(map(str, tokens)),
                   '--routing', r, '--ep-size', str(megamoe_ep_size(s)), '--json', json_path, '--no-stages',
                   *(['--git-rev', rev] if rev else []),
                   *([] if n == 0 else ['--no-ceilings']), *shlex.split(args.megamoe_args)]
            print('running:', shlex.join(cmd), flush=True)
            t0 = time.time()
            rc, out, err = run_cmd(cmd, left)
            log.write(f'$ {shlex.join(cmd)}\nrc={rc} ({time.time() - t0:.1f} s)\n--- stdout\n{out}\n--- stderr\n{err}\n')
            log.flush()
            print(out.strip()[-2000:], flush=True)
            if rc != 0:
                failures[(s, r)] = f'megamoe bench rc={rc}: {(err.strip() or out.strip())[-300:]}'
    recs, seen = [], set()
    if os.path.exists(json_path):
        with open(json_path) as f:
            for line in f:
                try:
                    raw = json.loads(line)
                except json.JSONDecodeError:
                    continue
                shape, t, us = _get(raw, 'shape'), _get(raw, 'tokens'), _get(raw, 'median_us')
                if raw.get('record', 'layer') != 'layer' or shape is None or t is None or us is None:
                    continue
                routing = _get(raw, 'routing') or 'uniform'
                ep = int(raw.get('ep_size', 1))
                rec = {**base, 'status': 'ok', 'shape': shape, 'tokens': int(t), 'routing': routing,
                       'median_us': float(us), 'min_us': _get(raw, 'min_us'), 'ep_size': ep,
                       'tflops': raw.get('tflops'), 'floor_us': raw.get('floor_us'),
                       'fraction_of_floor': raw.get('fraction_of_floor'), 'raw': raw,
                       'same_workload_as_peers': shape in SHAPES and ep == 1
                       and SHAPES[shape].bench_experts == SHAPES[shape].num_experts}
                if shape in SHAPES and rec['tflops'] is None:
                    rec['tflops'] = effective_tflops(SHAPES[shape], int(t), float(us))
                recs.append(rec)
                seen.add((shape, int(t), routing))
    for s, r in runs:
        for t in tokens:
            if (s, t, r) not in seen:
                reason = failures.get((s, r), 'megamoe bench wrote no result line for this point')
                recs.append({**base, 'shape': s, 'tokens': t, 'routing': r, 'status': 'missing', 'reason': reason})
    return recs


def unpack_packed_peers() -> list:
    """Packed pure-Python-plus-extension peers (.whl/*.tar.xz, fetch_wheels.sh) unpacked under /tmp."""
    paths = []
    for name in PACKED_PEERS:
        tarball = os.path.join(REPO, '.whl', name)
        if not os.path.isfile(tarball):
            continue
        dest = os.path.join(UNPACK_ROOT, name.split('.')[0])
        if not os.path.isdir(dest):
            os.makedirs(dest + '.partial', exist_ok=True)
            with tarfile.open(tarball) as tf:
                tf.extractall(dest + '.partial')
            os.rename(dest + '.partial', dest)
        paths.append(dest)
    return paths


def python_paths() -> list:
    return unpack_packed_peers() + ([PYLIB] if os.path.isdir(PYLIB) else [])


def peer_env() -> dict:
    env = dict(os.environ)
    paths = python_paths()
    if paths:
        env['PYTHONPATH'] = os.pathsep.join(paths + [env.get('PYTHONPATH', '')])
    env.setdefault('PYTHONUNBUFFERED', '1')
    env.setdefault('NCCL_NVLS_ENABLE', '0')
    env.setdefault('TORCH_SYMM_MEM_DISABLE_MULTICAST', '1')
    # DeepGEMM's and Triton's compile caches: start from carried ones (if any) so a fresh machine
    # skips the compiles an earlier run already did (same image, same sources: same cache keys).
    for var, carried, local in (('DG_JIT_CACHE_DIR', CARRIED_JIT_CACHE, JIT_CACHE),
                                ('TRITON_CACHE_DIR', CARRIED_TRITON_CACHE, TRITON_CACHE)):
        if var not in env:
            env[var] = local
            if os.path.isdir(carried) and not os.path.isdir(local):
                shutil.copytree(carried, local)
    return env


def collect(peer, shape, tokens, part, rc, log) -> list[dict]:
    got = []
    if os.path.exists(part):
        with open(part) as f:
            got = [json.loads(line) for line in f if line.strip()]
    done = {r['tokens'] for r in got}
    for t in tokens:
        if t not in done:
            tail = [l for l in log.strip().splitlines() if not l.startswith('$ ')][-3:]
            got.append({'system': peer, 'shape': shape, 'tokens': t, 'routing': 'uniform',
                        'status': 'error', 'reason': f'worker rc={rc}: ' + ' | '.join(tail)[-400:]})
    return sorted(got, key=lambda r: r['tokens'])


def warm_jit(args, shapes, tokens):
    """Runs the JIT-compiled peers once per T in parallel children (compiles are CPU-bound and the
    machine has 16 cores), so the timed sequential pass finds every kernel in the on-disk caches."""
    env = peer_env()
    jobs = [(p, s) for p in args.peers.split(',') if p in JIT_PEERS for s in shapes]
    procs = []
    t0 = time.time()
    for p, s in jobs:
        while len([q for q in procs if q[2].poll() is None]) >= args.warm_parallel:
            time.sleep(0.2)
            for _, _, q, _ in procs:
                if q.poll() is None and time.time() - t0 > args.warm_timeout:
                    q.kill()
        logf = open(os.path.join(args.out, f'warm_{p}_{s}.log'), 'w')
        cmd = [sys.executable, os.path.join(HERE, 'worker.py'), '--peer', p, '--shape', s, '--warm-only',
               '--tokens', ','.join(map(str, tokens))]
        procs.append((p, s, subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT), logf))
    for p, s, q, logf in procs:
        left = max(1.0, args.warm_timeout - (time.time() - t0))
        try:
            q.wait(timeout=left)
        except subprocess.TimeoutExpired:
            q.kill()
            q.wait()
        logf.close()
        print(f'[warm {p} / {s}] rc={q.returncode}', flush=True)
    print(f'JIT warm-up: {time.time() - t0:.0f} s', flush=True)


def run_peers(args, shapes, tokens) -> list[dict]:
    """One child per (peer, shape), sequentially (timings count); --parallel N runs N at once, which
    is only for checking correctness and warming the JIT caches: its times are marked and not valid."""
    env = peer_env()
    jobs = []
    for peer in args.peers.split(','):
        for shape in shapes:
            part = os.path.join(args.out, f'{peer}_{shape}.jsonl')
            if os.path.exists(part):
                os.remove(part)
            cmd = [sys.executable, os.path.join(HERE, 'worker.py'), '--peer', peer, '--shape', shape,
                   '--tokens', ','.join(map(str, tokens)), '--out', part,
                   '--budget-s', str(args.peer_timeout * 0.8), '--point-budget-s', str(args.point_budget_s)]
            jobs.append((peer, shape, part, cmd))
    if args.parallel > 1:   # compile-heavy children first, so their compiles overlap the rest
        jobs.sort(key=lambda j: j[0] not in JIT_PEERS)
    records = []
    pending = list(jobs)
    running = []
    deadline = time.time() + args.total_timeout if args.total_timeout > 0 else float('inf')
    while pending or running:
        if time.time() > deadline and pending:
            for peer, shape, part, cmd in pending:
                records += [{'system': peer, 'shape': shape, 'tokens': t, 'routing': 'uniform',
                             'status': 'skipped', 'reason': f'--total-timeout {args.total_timeout:.0f} s reached'}
                            for t in tokens]
            pending = []
        while pending and len(running) < max(1, args.parallel):
            peer, shape, part, cmd = pending.pop(0)
            logf = open(os.path.join(args.out, f'{peer}_{shape}.log'), 'w+')
            logf.write(f'$ {shlex.join(cmd)}\n')
            logf.flush()
            print(f'[{peer} / {shape}] started', flush=True)
            proc = subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT, text=True)
            running.append((peer, shape, part, proc, logf, time.time()))
        time.sleep(0.2)
        for item in list(running):
            peer, shape, part, proc, logf, t0 = item
            rc = proc.poll()
            if rc is None and (time.time() - t0 > args.peer_timeout or time.time() > deadline):
                proc.kill()
                proc.wait()
                rc = 'timeout'
            if rc is None:
                continue
            running.remove(item)
            logf.seek(0)
            log = logf.read()
            logf.write(f'\nrc={rc} ({time.time() - t0:.1f} s)\n')
            logf.close()
            got = collect(peer, shape, tokens, part, rc, log)
            if args.parallel > 1:
                for r in got:
                    r['parallel_run'] = True
                    if r.get('status') == 'ok':
                        r['status'] = 'ok-parallel'
                        r['reason'] = 'timed while other peers ran (--parallel): not a valid time'
            print(f'[{peer} / {shape}] rc={rc} in {time.time() - t0:.1f} s', flush=True)
            for r in got:
                print('   ', summarize(r), flush=True)
            records += got
    return records


def summarize(r: dict) -> str:
    if r.get('status') not in ('ok', 'ok-parallel'):
        return f"T={r['tokens']}: {r.get('status')}: {r.get('reason', '')}"
    return (f"T={r['tokens']}: {r['median_us']:.1f} us, {r.get('tflops', 0):.1f} TFLOP/s, "
            f"check {r.get('check')} (diff {r.get('diff_vs_ideal', float('nan')):.2e}, "
            f"worst row {r.get('worst_row_diff_vs_ideal', float('nan')):.2e}), {r.get('mode')}")


def fmt(v, spec):
    return format(v, spec) if isinstance(v, (int, float)) else '-'


def megamoe_times(records) -> dict:
    """(shape, T) -> (megamoe time, which run): megamoe-py (same inputs as the peers) where it ran
    and passed its check, else megamoe bench's uniform-routing time."""
    best = {}
    for r in records:
        if r.get('status') != 'ok':
            continue
        key = (r.get('shape'), r.get('tokens'))
        if (r['system'] == MEGAMOE and r.get('routing', 'uniform') == 'uniform'
                and r.get('same_workload_as_peers')):
            best.setdefault(key, (r['median_us'], 'megamoe bench'))
        elif r['system'] == MEGAMOE_PY and r.get('check') == 'pass':
            best[key] = (r['median_us'], MEGAMOE_PY)
    for r in records:   # megamoe-py wins over the bench even if the bench line came later
        if r['system'] == MEGAMOE_PY and r.get('status') == 'ok' and r.get('check') == 'pass':
            best[(r['shape'], r['tokens'])] = (r['median_us'], MEGAMOE_PY)
    return best


def make_table(records, shapes, tokens) -> str:
    mm = megamoe_times(records)
    lines = ['| shape | T | routing | system | median us | min us | TFLOP/s | floor us | frac of floor '
             '| megamoe/peer | check: diff vs FP64 ideal (worst row); diff vs contract | status |',
             '|---|---|---|---|---|---|---|---|---|---|---|---|']
    systems = [MEGAMOE] + [p for p in SYSTEMS if any(r['system'] == p for r in records)]
    for s in shapes:
        for t in tokens:
            peer_floor = floors(SHAPES[s], t)['floor_us']
            for sysname in systems:
                rows = [r for r in records if r['system'] == sysname and r['shape'] == s and r['tokens'] == t]
                for r in sorted(rows, key=lambda r: r.get('routing', '')):
                    ok = r.get('status') == 'ok'
                    ratio = '-'
                    m = mm.get((s, t))
                    if ok and sysname in PEERS and m:
                        ratio = f"{m[0] / r['median_us']:.2f}" + ('' if m[1] == MEGAMOE_PY else ' (bench)')
                    check = '-'
                    if 'diff_vs_ideal' in r:
                        check = (f"{r.get('check')}: {r['diff_vs_ideal']:.1e} ({r['worst_row_diff_vs_ideal']:.1e}); "
                                 f"vs contract {r.get('diff_vs_contract', float('nan')):.1e}")
                    status = 'ok' if ok else f"{r.get('status')}: {r.get('reason', '')}"
                    fl = peer_floor
                    if sysname == MEGAMOE and ok:
                        fl = r.get('floor_us') or peer_floor
                        if not r.get('same_workload_as_peers'):
                            status += (f" (bench workload: EP{r.get('ep_size')} rank 0 of T tokens routed over all "
                                       f"{SHAPES[s].num_experts} experts)")
                    if ok and r.get('mode') and r['mode'] != 'cuda_graph':
                        status += f" ({r['mode']})"
                    lines.append(f"| {s} | {t} | {r.get('routing', 'uniform')} | {sysname} | "
                                 f"{fmt(r.get('median_us'), '.1f')} | {fmt(r.get('min_us'), '.1f')} | "
                                 f"{fmt(r.get('tflops'), '.1f')} | {fmt(fl, '.1f')} | {fmt(r.get('fraction_of_floor'), '.2f')} | "
                                 f"{ratio} | {check} | {status} |")
                    if ok and r.get('gemms_only_median_us'):
                        g_us = r['gemms_only_median_us']
                        g_ratio = '-'
                        if sysname in PEERS and m:
                            g_ratio = f"{m[0] / g_us:.2f}" + ('' if m[1] == MEGAMOE_PY else ' (bench)')
                        g_tflops = effective_tflops(SHAPES[s], t, g_us)
                        lines.append(f"| {s} | {t} | {r.get('routing', 'uniform')} | {sysname} [GEMMs only] | "
                                     f"{g_us:.1f} | {fmt(r.get('gemms_only_min_us'), '.1f')} | {g_tflops:.1f} | "
                                     f"{fl:.1f} | {fl / g_us:.2f} | {g_ratio} | - | lower bound: its GEMM kernels "
                                     f"alone, glue left out (not a layer) |")
    return '\n'.join(lines)


def make_plot(records, shapes, tokens, path) -> str:
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except Exception as exc:
        return f'no plot: matplotlib unavailable ({exc})'
    fig, axes = plt.subplots(1, len(shapes), figsize=(6.5 * len(shapes), 5), squeeze=False)
    for ax, s in zip(axes[0], shapes):
        ax.plot(tokens, [floors(SHAPES[s], t)['floor_us'] for t in tokens], 'k--', lw=2, label='floor (targets.md)')
        series = {}
        for r in records:
            if r.get('shape') == s and r.get('status') == 'ok' and r.get('check', 'pass') == 'pass':
                if r.get('gemms_only_median_us'):
                    series.setdefault(r['system'] + ' [GEMMs only]', []).append((r['tokens'], r['gemms_only_median_us']))
                key = r['system'] + ('' if r.get('routing', 'uniform') == 'uniform' else f" ({r['routing']})")
                if r['system'] == MEGAMOE and not r.get('same_workload_as_peers', True):
                    key += f" [bench: EP{r.get('ep_size')} rank-0 share]"
                series.setdefault(key, []).append((r['tokens'], r['median_us']))
        for key, pts in sorted(series.items()):
            pts.sort()
            style = ':' if '(' in key else '--' if 'GEMMs only' in key else '-'
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker='o', label=key)
        ax.set_xscale('log')
        ax.set_yscale('log')
        ax.set_xticks(tokens)
        ax.set_xticklabels([str(t) for t in tokens])
        ax.minorticks_off()
        sh = SHAPES[s]
        ax.set_title(f'{s}: H={sh.hidden} I={sh.intermediate} E={sh.bench_experts} K={sh.top_k} (peers: uniform routing)',
                     fontsize=10)
        ax.set_xlabel('tokens per rank')
        ax.set_ylabel('time per layer (us, median)')
        ax.grid(True, which='both', alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--megamoe-bin', default=os.path.join(REPO, 'build', 'megamoe'))
    ap.add_argument('--megamoe-args', default='',
                    help='extra arguments appended to every `megamoe bench` command (e.g. --exact, --replays 20)')
    ap.add_argument('--megamoe-routings', default='uniform,skewed', help='routing kinds megamoe bench runs')
    ap.add_argument('--megamoe-timeout', type=float, default=240.0, help='seconds for all megamoe bench runs')
    ap.add_argument('--out', default=os.path.join(REPO, 'results'))
    ap.add_argument('--shapes', default=','.join(DEFAULT_SHAPES))
    ap.add_argument('--tokens', default=','.join(map(str, TOKEN_COUNTS)))
    ap.add_argument('--peers', default=','.join(SYSTEMS))
    ap.add_argument('--peer-timeout', type=float, default=150.0, help='seconds per (peer, shape) child process')
    ap.add_argument('--point-budget-s', type=float, default=0.25, help='timed seconds per point')
    ap.add_argument('--skip-megamoe', action='store_true')
    ap.add_argument('--warm-parallel', type=int, default=0,
                    help='before timing, run the JIT peers once per T in this many parallel children')
    ap.add_argument('--warm-timeout', type=float, default=180.0)
    ap.add_argument('--total-timeout', type=float, default=0.0,
                    help='seconds for all peer children together (0: none); the rest is marked skipped')
    ap.add_argument('--parallel', type=int, default=1,
                    help='children at once; > 1 only to check correctness / warm JIT caches (times invalid)')
    args = ap.parse_args()
    shapes = args.shapes.split(',')
    for s in shapes:
        if s not in SHAPES:
            ap.error(f'--shapes: unknown shape {s!r}; expected some of {sorted(SHAPES)}')
    for p in args.peers.split(','):
        if p not in SYSTEMS:
            ap.error(f'--peers: unknown peer {p!r}; expected some of {list(SYSTEMS)}')
    tokens = [int(t) for t in args.tokens.split(',')]
    os.makedirs(args.out, exist_ok=True)
    t_start = time.time()

    for path in reversed(python_paths()):
        sys.path.insert(0, path)
    env = environment()
    print(json.dumps(env), flush=True)
    records = [env]
    rc, out, err = run_cmd([sys.executable, os.path.join(HERE, 'worker.py'), '--ceilings'], 120)
    ceil = [json.loads(l) for l in out.splitlines() if l.startswith('{')]
    records += ceil or [{'system': 'ceilings', 'status': 'error', 'reason': f'rc={rc}: {err.strip()[-300:]}'}]
    print('ceilings:', json.dumps(records[-1]), flush=True)
    if args.skip_megamoe:
        records += [{'system': MEGAMOE, 'shape': s, 'tokens': t, 'routing': 'uniform', 'status': 'missing',
                     'reason': 'skipped (--skip-megamoe)'} for s in shapes for t in tokens]
    else:
        records += run_megamoe(args, shapes, tokens)
    if args.warm_parallel > 0:
        warm_jit(args, shapes, tokens)
    records += run_peers(args, shapes, tokens)

    with open(os.path.join(args.out, 'peers.jsonl'), 'w') as f:
        for r in records:
            f.write(json.dumps(r, sort_keys=True) + '\n')
    table = make_table(records, shapes, tokens)
    header = (f"GPU {env.get('gpu', '?')}, driver {env.get('driver', '?')}, SM clock {env.get('clock_sm', '?')} "
              f"(max {env.get('clock_max_sm', '?')}), torch {env.get('torch', '?')}, CUDA {env.get('cuda', '?')}, "
              f"git {env.get('git_rev', '?')[:12]}{' (dirty)' if env.get('git_dirty') else ''}\n"
              f"ceilings this run: {json.dumps({k: round(v, 2) for k, v in records[1].items() if isinstance(v, float)})}\n"
              f"kimi-k3 runs E = {SHAPES['kimi-k3'].bench_experts} experts (EP8 per-rank work), the other shapes all "
              f"experts; uniform routing, seeded; megamoe/peer = megamoe time / peer time (< 1: megamoe faster), megamoe "
              f"being {MEGAMOE_PY} on the peers' exact inputs where it ran, else megamoe bench (marked '(bench)').\n")
    with open(os.path.join(args.out, 'table.md'), 'w') as f:
        f.write(header + '\n' + table + '\n')
    plot = make_plot(records, shapes, tokens, os.path.join(args.out, 'peers.png'))
    print('\n' + header + '\n' + table, flush=True)
    print(f'\nwrote {args.out}/peers.jsonl, table.md, {plot}; {time.time() - t_start:.0f} s in all', flush=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())
