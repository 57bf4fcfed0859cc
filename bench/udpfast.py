#!/usr/bin/env python3
"""Packed UDP (bench row 2b) by stage, and the pinned variant of row 2b.

Two uses:

* `python3 bench/udpfast.py profile [--build DIR] [--rate R] [--seconds S] [--pin]`
  starts one bucketd (one UDP listener, sink: blackhole), runs the row 2b load (bucketd-sim,
  1000 sensors, 3 fields, 400 readings a datagram up to 60,000 bytes) at --rate for --seconds,
  and reports for the ingest thread (the daemon's main thread, which runs the uv loop) and the
  flusher thread their CPU time per reading accepted (`perf stat -e task-clock -t TID`), and
  for the ingest thread the split of its time by stage from `perf record -e cpu-clock`
  (symbols mapped to stages by STAGES below). Machines without a PMU (most VMs) have no
  `cycles` event: cycles are task-clock ns times the nominal clock (/proc/cpuinfo), said so.
  --pin puts the ingest thread alone on CPU 1 and the flusher and the sender on CPU 0.

* `python3 bench/udpfast.py callgrind [--build DIR] [--count N] [--rate R]` runs the daemon
  under valgrind's callgrind with the row 2b load, paced low (valgrind runs it some 50 times
  slower), and prints instructions per reading accepted by stage (inclusive counts of the
  functions in CALLGRIND_STAGES): counts that do not depend on what else the machine runs, for
  A/B comparisons on a shared machine. User space only (recvmmsg's kernel side is not
  counted); valgrind reports a CPU without AVX-512, so the parser runs its AVX2 classifier.

* `fig_udp_pinned(ctx)` from bench/suite.py: row 2b's zero-loss search with the daemon's
  ingest thread pinned alone on the last CPU and everything else (flusher, sender) on the
  others, as issue 28 states the target ("ingest thread alone on its core").
"""
import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

# Symbol (prefix match, first hit wins) -> stage of the ingest hot path. The index probe and the
# id comparison are inlined into bd_sensor_table_accept, so their time shows under encode +
# push; the lookup stage is what stays a call (XXH3, and memcmp before ids were compared inline).
STAGES = [
    ('recvmmsg (kernel + libuv)', ('[k]', 'uv__', 'recvmmsg', '__libc_recv', 'syscall')),
    ('line split + parse', ('parse_', 'plain_', 'classify_', 'window_fill', 'line_end',
                            'bd_parse_', 'flatten_', 'bits_', 'memchr', '__memchr')),
    ('sensor lookup (hash + probe)', ('XXH3', 'lookup', '__memcmp', 'memcmp', 'sensor_lookup',
                                      'same_sensor')),
    ('cell encode + push', ('bd_sensor_table_accept', 'push', 'field_index', 'bd_pool_take',
                            'new_segment', '__memmove', 'memcpy', 'accept_', 'copy_cells')),
    ('publish / hand-off', ('mark_dirty', 'settle_rechecks', 'enqueue', 'bd_ring_',
                            'take_back_idle', 'bd_sensor_table_publish')),
    ('ingest glue (line_result, udp callback)', ('line_result', 'ingest_', 'on_udp_recv',
                                                 'udp_datagram', 'udp_maybe_pause')),
]

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)



def wait_ready(log, timeout, interval):
    """Until the daemon's log (a file open w+) says it is ready, or timeout seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        log.seek(0)
        if 'ready' in log.read():
            return
        time.sleep(interval)

def stage_of(sym):
    for name, prefixes in STAGES:
        if any(sym.startswith(p) for p in prefixes):
            return name
    return 'other'


def cpu_mhz():
    try:
        with open('/proc/cpuinfo') as f:
            m = re.search(r'cpu MHz\s*:\s*([0-9.]+)', f.read())
            return float(m.group(1)) if m else None
    except OSError:
        return None


def task_clock_ms(path):
    with open(path) as f:
        m = re.search(r'([0-9.,]+)\s+msec task-clock', f.read())
    return float(m.group(1).replace(',', '')) if m else None


def parse_stats(text):
    stats = None
    for line in text.splitlines():
        i = line.find('stats: ')
        if i >= 0:
            stats = {k: int(v) for k, _, v in (t.partition('=') for t in line[i + 7:].split())
                     if v.isdigit()}
    return stats


def daemon_config(work, port):
    return '\n'.join([
        'writer_id: bench', 'listeners:', '  - proto: udp', '    bind: "127.0.0.1:%d"' % port,
        '    format: influx', 'sink: blackhole', 'flush:', '  interval: 1s',
        '  stop_timeout: 60s', 'spool:', '  dir: %s' % os.path.join(work, 'spool'),
        'metrics:', '  bind: ""', 'log:', '  level: info', 'time:', '  wait_for_sync: 0s']) + '\n'


def threads(pid):
    """(ingest tid, [other tids]): the main thread runs the uv loop (src/daemon.c)."""
    tids = sorted(int(t) for t in os.listdir('/proc/%d/task' % pid))
    return pid, [t for t in tids if t != pid]


def pin(tid, cpus):
    subprocess.run(['taskset', '-pc', cpus, str(tid)], stdout=subprocess.DEVNULL, check=True)


def sim_args(port, rate, seconds):
    return ['--target', '127.0.0.1:%d' % port, '--proto', 'udp', '--sensors', '1000',
            '--fields', '3', '--per-datagram', '400', '--max-datagram', '60000',
            '--rate', str(int(rate)), '--duration', '%g' % seconds, '--quiet']


def profile(build, rate, seconds, do_pin, record=True, port=47311):
    work = tempfile.mkdtemp(prefix='udpfast-')
    os.makedirs(os.path.join(work, 'spool'))
    cfg = os.path.join(work, 'bd.yaml')
    with open(cfg, 'w') as f:
        f.write(daemon_config(work, port))
    log = open(os.path.join(work, 'bd.log'), 'w+')
    d = subprocess.Popen([os.path.join(build, 'bucketd'), '-c', cfg], stdout=log,
                         stderr=subprocess.STDOUT)
    try:
        wait_ready(log, 20, 0.05)
        time.sleep(0.2)
        ingest, others = threads(d.pid)
        ncpu = os.cpu_count()
        sim_prefix = []
        if do_pin:
            last = str(ncpu - 1)
            rest = '0-%d' % (ncpu - 2) if ncpu > 2 else '0'
            pin(ingest, last)
            for t in others:
                pin(t, rest)
            sim_prefix = ['taskset', '-c', rest]
        stats_f = [os.path.join(work, 'stat.%d' % t) for t in [ingest] + others]
        perfs = [subprocess.Popen(['perf', 'stat', '-e', 'task-clock', '-t', str(t), '-o', p],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                 for t, p in zip([ingest] + others, stats_f)]
        rec_f = os.path.join(work, 'ingest.data')
        if record:
            perfs.append(subprocess.Popen(['perf', 'record', '-e', 'cpu-clock', '-F', '10000',
                                           '-t', str(ingest), '-o', rec_f],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(0.5)
        sp = subprocess.Popen(sim_prefix + [os.path.join(build, 'bucketd-sim')] +
                              sim_args(port, rate, seconds), stdout=subprocess.PIPE)
        out = sp.stdout.read().decode()
        _, status, ru = os.wait4(sp.pid, 0)
        sp.returncode = status
        sim = json.loads(out.strip().splitlines()[-1])
        sender_ms = (ru.ru_utime + ru.ru_stime) * 1e3
        time.sleep(1.5)  # the socket and the rings drain
        for p in perfs:
            p.send_signal(signal.SIGINT)
        for p in perfs:
            p.wait(30)
    finally:
        d.send_signal(signal.SIGTERM)
        d.wait(60)
    log.seek(0)
    st = parse_stats(log.read()) or {}
    acc = st.get('readings_accepted', 0)
    mhz = cpu_mhz()
    res = {'rate': rate, 'sent': sim['readings'], 'sent_per_s': sim['readings_per_s'],
           'accepted': acc, 'kernel_drops': st.get('udp_socket_drops'),
           'drops': {k: v for k, v in st.items() if k.startswith('drop_') and v},
           'pinned': do_pin, 'mhz': mhz, 'threads': {}}
    sent = sim['readings']
    res['threads']['sender'] = {'cpu_ms': round(sender_ms, 1),
                                'ns_per_reading': round(sender_ms * 1e6 / sent, 1),
                                'cycles_per_reading': round(sender_ms * 1e6 / sent * mhz / 1e3, 1)
                                if mhz else None}
    # With the blackhole sink the daemon has two threads: the main one (ingest) and the flusher.
    names = ['ingest'] + (['flusher'] if len(stats_f) == 2 else
                          ['thread%d' % i for i in range(1, len(stats_f))])
    for name, path in zip(names, stats_f):
        ms = task_clock_ms(path)
        if ms is not None and acc:
            ns = ms * 1e6 / acc
            res['threads'][name] = {'cpu_ms': ms, 'ns_per_reading': round(ns, 1),
                                    'cycles_per_reading': round(ns * mhz / 1e3, 1) if mhz else None}
    if record and acc:
        rep = subprocess.run(['perf', 'report', '-i', rec_f, '--no-children', '--sort', 'sym',
                              '--stdio', '--percent-limit', '0'], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL).stdout.decode()
        stages = {}
        for line in rep.splitlines():
            m = re.match(r'\s*([0-9.]+)%\s+\[(.)\]\s+(\S+)', line)
            if not m:
                continue
            sym = '[k]' if m.group(2) == 'k' else m.group(3)
            st_name = stage_of(sym)
            stages[st_name] = stages.get(st_name, 0.0) + float(m.group(1))
        ing = res['threads'].get('ingest')
        res['stages'] = {}
        for k, pct in sorted(stages.items(), key=lambda kv: -kv[1]):
            e = {'pct': round(pct, 1)}
            if ing and ing.get('cycles_per_reading') is not None:
                e['cycles_per_reading'] = round(ing['cycles_per_reading'] * pct / 100, 1)
            res['stages'][k] = e
    return res


def print_profile(res):
    print('rate %s: sent %d (%.2f M/s), accepted %d, kernel drops %s, drops %s, pinned %s' % (
        res['rate'] or 'flat-out', res['sent'], res['sent_per_s'] / 1e6, res['accepted'],
        res['kernel_drops'], res['drops'] or '{}', res['pinned']))
    for name, t in res['threads'].items():
        print('  %-8s %8.1f ms CPU  %6.1f ns/reading  %6.1f cycles/reading (@%.0f MHz)' % (
            name, t['cpu_ms'], t['ns_per_reading'], t['cycles_per_reading'] or 0, res['mhz']))
    for k, e in res.get('stages', {}).items():
        print('  ingest stage %-42s %5.1f%%  %6.1f cycles/reading' % (
            k, e['pct'], e.get('cycles_per_reading', 0)))


# ---------------------------------------------------------------------------------------------
# Suite hook: row 2b with the ingest thread pinned alone on a core.
# ---------------------------------------------------------------------------------------------

def pinning():
    """(ingest CPU, the other CPUs) as taskset lists: the last CPU alone for the ingest thread."""
    ncpu = os.cpu_count() or 1
    return str(ncpu - 1), ('0-%d' % (ncpu - 2) if ncpu > 2 else '0')


def pin_daemon(pid):
    """The daemon's ingest thread (its main thread) alone on the last CPU, the others on the
    rest."""
    alone, rest = pinning()
    ingest, others = threads(pid)
    pin(ingest, alone)
    for t in others:
        pin(t, rest)


def pinned_trial(ctx, suite, receiver, load, rate):
    """suite.Context.udp_trial with the receiver pinned: bucketd's ingest thread (or the whole
    bench_udp_sink) alone on the last CPU, the flusher and bucketd-sim on the others."""
    alone, rest = pinning()
    port = suite.free_port('udp')
    if receiver == 'sink':
        rx = suite.Sink(ctx, port)
        subprocess.run(['taskset', '-apc', alone, str(rx.proc.pid)], stdout=subprocess.DEVNULL,
                       check=True)
    else:
        rx = suite.Bucketd(ctx, 'udp-pinned-%d' % port, [('udp', port, load.fmt)]).start()
        pin_daemon(rx.pid)
    try:
        k0 = suite.read_snmp_udp()
        p = ctx.procs.spawn('bucketd-sim', ['taskset', '-c', rest, ctx.bin('bucketd-sim')] +
                            load.args(port, rate=rate, duration=ctx.step_s),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        res = suite.finish_sim(ctx, p, ctx.step_s + 60)
        drained = suite.wait_rx_drained(port)
        k1 = suite.read_snmp_udp()
    finally:
        got = rx.stop()
    return suite.udp_outcome(receiver, rate, res, got, k0, k1, drained, label='pinned ')


def fig_udp_pinned(ctx, suite):
    """Row 2b pinned: the zero-loss search of row 2b (ctx.udp_search) with every trial pinned
    as pinned_trial() says. ctx is the suite's context, suite the suite module."""
    alone, rest = pinning()
    figure = ('2b pinned. UDP -> blackhole, packed, receiver alone on CPU %s, sender and '
              'flusher on CPU %s (readings/s, zero loss)' % (alone, rest))
    if (os.cpu_count() or 1) < 2:
        ctx.rows.append(suite.not_run(figure, 'needs 2 CPUs'))
        return
    load = suite.Load(ctx.udp_sensors, ctx.fields, per_datagram=400, max_datagram=60000)
    ctx.udp_trial = lambda receiver, load, rate: pinned_trial(ctx, suite, receiver, load, rate)
    try:
        sbest, strials = ctx.udp_search('sink', load)
        bbest, btrials = ctx.udp_search('bucketd', load)
    except suite.BenchError as e:
        ctx.rows.append(suite.not_run(figure, e))
        return
    finally:
        del ctx.udp_trial  # the class's own again
    ctx.describe_search('packed pinned sink', sbest, strials)
    ctx.describe_search('packed pinned bucketd', bbest, btrials)
    bval = bbest['sent_per_s'] if bbest else None
    sval = sbest['sent_per_s'] if sbest else None
    bcell = (suite.si(bval) if bbest else 'no zero-loss rate found') + suite.flat_label(btrials)
    scell = 'bench_udp_sink %s' % (suite.si(sval) if sbest else 'no zero-loss rate found')
    ratio = bval / sval if bval and sval else None
    ctx.rows.append(suite.Row(figure + ' [%s]' % load.describe(), bcell,
                              scell + suite.flat_label(strials),
                              suite.pct(ratio) if ratio else 'n/a', '>= 8 M readings/s',
                              suite.met_ge(bval or 0, 8e6)))
    ctx.conditions.append('2b pinned: taskset, the receiver (bucketd\'s main thread, which '
                          'runs the ingest loop, or all of bench_udp_sink) on CPU %s, '
                          'bucketd\'s other threads and bucketd-sim on CPU %s' % (alone, rest))


# Stage -> function whose inclusive count is the stage (callgrind), and the function whose
# inclusive count is the whole ingest path of a datagram.
CALLGRIND_STAGES = [
    ('line split + parse (bd_parse_begin + bd_parse_next)', ('bd_parse_begin', 'bd_parse_next')),
    ('sensor accept: lookup + encode + push (bd_sensor_table_accept)',
     ('bd_sensor_table_accept',)),
    ('  of which XXH3 of the series key', ('XXH3_64bits',)),
    ('flusher drain (flusher_drain_run, other thread)', ('flusher_drain_run',)),
]


def callgrind(build, count, rate, port=47321):
    work = tempfile.mkdtemp(prefix='udpfast-cg-')
    os.makedirs(os.path.join(work, 'spool'))
    cfg = os.path.join(work, 'bd.yaml')
    with open(cfg, 'w') as f:
        f.write(daemon_config(work, port))
    out = os.path.join(work, 'callgrind.out')
    log = open(os.path.join(work, 'bd.log'), 'w+')
    d = subprocess.Popen(['valgrind', '--tool=callgrind', '--callgrind-out-file=' + out,
                          os.path.join(build, 'bucketd'), '-c', cfg], stdout=log,
                         stderr=subprocess.STDOUT)
    try:
        wait_ready(log, 120, 0.2)
        args = sim_args(port, rate, 0)
        args[args.index('--duration'):args.index('--duration') + 2] = ['--count', str(count)]
        subprocess.run([os.path.join(build, 'bucketd-sim')] + args, stdout=subprocess.DEVNULL,
                       check=True)
        time.sleep(3)
    finally:
        d.send_signal(signal.SIGTERM)
        d.wait(300)
    log.seek(0)
    st = parse_stats(log.read()) or {}
    acc = st.get('readings_accepted', 0)
    rep = subprocess.run(['callgrind_annotate', '--inclusive=yes', '--show-percs=no', out],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL).stdout.decode()
    incl = {}
    for line in rep.splitlines():
        m = re.match(r'\s*([0-9,]+)\s+\S+?:(\S+)(\s|$)', line)
        if m:
            incl.setdefault(m.group(2), int(m.group(1).replace(',', '')))
    res = {'accepted': acc, 'kernel_drops': st.get('udp_socket_drops'), 'stages': {},
           'ingest_total': round(incl.get('on_udp_recv', 0) / acc, 1) if acc else None}
    for name, fns in CALLGRIND_STAGES:
        res['stages'][name] = round(sum(incl.get(f, 0) for f in fns) / acc, 1) if acc else None
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('what', choices=['profile', 'callgrind'])
    ap.add_argument('--build', default=os.path.join(REPO, 'build'))
    ap.add_argument('--rate', type=float, default=None,
                    help='readings/s (profile: default 2 M; callgrind: default 50 k)')
    ap.add_argument('--count', type=int, default=200000, help='callgrind: readings sent')
    ap.add_argument('--seconds', type=float, default=4)
    ap.add_argument('--pin', action='store_true')
    ap.add_argument('--no-record', action='store_true')
    ap.add_argument('--json', action='store_true')
    ap.add_argument('--port', type=int, default=47321)
    a = ap.parse_args()
    if a.what == 'callgrind':
        res = callgrind(a.build, a.count, a.rate or 50000, port=a.port)
        if a.json:
            print(json.dumps(res))
        else:
            print('readings accepted %d (kernel drops %s: valgrind is slow; counts are per '
                  'reading accepted)' % (res['accepted'], res['kernel_drops']))
            print('  %-66s %7.0f instructions/reading' % ('ingest, whole (on_udp_recv)',
                                                          res['ingest_total'] or 0))
            for k, v in res['stages'].items():
                print('  %-66s %7.0f' % (k, v or 0))
        return 0
    res = profile(a.build, a.rate or 2e6, a.seconds, a.pin, record=not a.no_record, port=a.port)
    if a.json:
        print(json.dumps(res))
    else:
        print_profile(res)


if __name__ == '__main__':
    sys.exit(main())
