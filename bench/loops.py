"""Bench row 2c: ingest.loops 1 vs 2 (UDP into the blackhole sink).

Called by suite.py (fig 'loops'). The kernel spreads datagrams over a SO_REUSEPORT group by
4-tuple, so one sender socket would reach one loop only: the load comes from SENDERS
bucketd-sim processes (one socket, one source port each) flat out for step_s seconds, the
same series in each. Trials alternate 1 and 2 loops (the machine is shared: alternation keeps
slow phases from landing on one side). Reported per trial: readings accepted per second of
the run, loss (sent - accepted, kernel drops), and CPU seconds per million readings of the
ingest thread and of the whole daemon; the senders share the cores with the daemon.
"""

import os
import time

import suite as S

SENDERS = 4


def recv_cpu(pid, cpu):
    """CPU seconds of the receive loops' threads (named bd-recv-N) in a thread_cpu() dict."""
    total = 0.0
    for tid, sec in cpu.items():
        try:
            with open('/proc/%d/task/%d/comm' % (pid, tid)) as f:
                if f.read().startswith('bd-recv'):
                    total += sec
        except OSError:
            pass
    return total


def trial(ctx, loops, load, rate=0):
    port = S.free_port('udp')
    d = S.Bucketd(ctx, 'loops%d-%d' % (loops, port), [('udp', port, load.fmt)],
                  extra=['ingest:', '  loops: %d' % loops]).start()
    try:
        k0 = S.read_snmp_udp()
        c0 = S.thread_cpu(d.pid)
        p0 = S.cpu_seconds(d.pid)
        procs = [S.start_sim(ctx, S.Load(load.sensors, load.fields, load.per_datagram,
                                          load.max_datagram, seed=10 + i).args(
                                              port, rate=rate / SENDERS, duration=ctx.step_s))
                 for i in range(SENDERS)]
        res = [S.finish_sim(ctx, p, ctx.step_s + 60) for p in procs]
        S.wait_rx_drained(port)
        time.sleep(0.5)
        c1 = S.thread_cpu(d.pid)
        r1 = recv_cpu(d.pid, c1)
        p1 = S.cpu_seconds(d.pid)
        k1 = S.read_snmp_udp()
    finally:
        got = d.stop()
    sent = sum(r['readings'] for r in res)
    elapsed = max(r['elapsed_s'] for r in res)
    accepted = got.get('readings_accepted', 0) if got else 0
    ingest_cpu = c1.get(d.pid, 0.0) - c0.get(d.pid, 0.0)
    t = {'loops': loops, 'sent': sent, 'accepted': accepted, 'elapsed': elapsed,
         'rate': accepted / max(elapsed, 1e-9),
         'kernel': k1.get('RcvbufErrors', 0) - k0.get('RcvbufErrors', 0),
         'socket_drops': (got or {}).get('udp_socket_drops', 0),
         'drops': S.daemon_drops(got or {}),
         'other': (got or {}).get('udp_datagrams_other_loops', 0),
         'datagrams': (got or {}).get('udp_datagrams', 0),
         'ingest_cpu_per_m': ingest_cpu / max(accepted, 1) * 1e6,
         'daemon_cpu_per_m': (p1 - p0) / max(accepted, 1) * 1e6,
         'recv_cpu_per_m': (r1 - recv_cpu(d.pid, c0)) / max(accepted, 1) * 1e6}
    S.log('  loops=%d rate=%s: sent %d accepted %d (%s/s) kernel drops %d (udp_socket_drops '
          '%d), daemon drops %s, %d of %d datagrams via loop 2; ingest thread %.3f s CPU per M '
          'readings, receive loop %.3f, daemon %.3f'
          % (loops, S.si(rate) if rate else 'flat-out', sent, accepted, S.si(t['rate']),
             t['kernel'], t['socket_drops'], t['drops'] or '{}',
             t['other'], t['datagrams'], t['ingest_cpu_per_m'], t['recv_cpu_per_m'], t['daemon_cpu_per_m']))
    return t


def fig_loops(ctx):
    ctx.have_sim()
    runs = 1 if ctx.quick else 3
    cases = [('2c. UDP -> blackhole, packed, ingest.loops 1 vs 2 (readings/s accepted, '
              '%d senders flat out)' % SENDERS,
              S.Load(ctx.udp_sensors, ctx.fields, per_datagram=400, max_datagram=60000)),
             ('2c. UDP -> blackhole, 1 reading/datagram, ingest.loops 1 vs 2 (readings/s '
              'accepted, %d senders flat out)' % SENDERS, S.Load(ctx.udp_sensors, ctx.fields))]
    for figure, load in cases:
        trials = {1: [], 2: []}
        try:
            for _ in range(runs):
                for loops in (1, 2):
                    trials[loops].append(trial(ctx, loops, load))
        except S.BenchError as e:
            ctx.rows.append(S.not_run(figure, e))
            continue

        def show(ts):
            return ' / '.join('%s%s' % (S.si(t['rate']), '' if t['sent'] == t['accepted']
                                        else ' (lost %s)' % S.pct(1 - t['accepted'] /
                                                                  max(t['sent'], 1)))
                              for t in ts)

        def best(ts):
            return max(t['rate'] for t in ts)

        ratio = best(trials[2]) / max(best(trials[1]), 1e-9)
        ctx.rows.append(S.Row(figure, '2 loops: %s' % show(trials[2]),
                              '1 loop: %s' % show(trials[1]), '%.2fx' % ratio,
                              'report honestly (2 cores shared with the senders)', 'n/a'))
        cpu = lambda ts, k: min(t[k] for t in ts)  # noqa: E731
        ctx.note('%s: ingest thread CPU s per M readings 1 loop %.3f, 2 loops %.3f; whole '
                 'daemon 1 loop %.3f, 2 loops %.3f (best of %d); datagrams via loop 2: %s' % (
                     figure.split(',')[1].strip(), cpu(trials[1], 'ingest_cpu_per_m'),
                     cpu(trials[2], 'ingest_cpu_per_m'), cpu(trials[1], 'daemon_cpu_per_m'),
                     cpu(trials[2], 'daemon_cpu_per_m'), runs,
                     ', '.join('%d of %d' % (t['other'], t['datagrams']) for t in trials[2])))
    # The cost per reading without overload: a fixed total rate the daemon takes without loss
    # on this box, so that the CPU figures are not those of a starved process.
    for name, load, rate in (('packed 400/datagram', cases[0][1], 1000000),
                             ('1 reading/datagram', cases[1][1], 40000)):
        per = {1: [], 2: []}
        try:
            for _ in range(runs):
                for loops in (1, 2):
                    per[loops].append(trial(ctx, loops, load, rate))
        except S.BenchError as e:
            ctx.note('2c at a fixed rate, %s: not run: %s' % (name, e))
            continue
        ctx.note('2c at %s readings/s (%d senders), %s: CPU s per M readings, ingest thread: '
                 '1 loop %s, 2 loops %s; second receive loop: %s; whole daemon: 1 loop %s, '
                 '2 loops %s; datagrams via loop 2: %s; readings lost: %s' % (
                     S.si(rate), SENDERS, name,
                     ' / '.join('%.3f' % t['ingest_cpu_per_m'] for t in per[1]),
                     ' / '.join('%.3f' % t['ingest_cpu_per_m'] for t in per[2]),
                     ' / '.join('%.3f' % t['recv_cpu_per_m'] for t in per[2]),
                     ' / '.join('%.3f' % t['daemon_cpu_per_m'] for t in per[1]),
                     ' / '.join('%.3f' % t['daemon_cpu_per_m'] for t in per[2]),
                     ', '.join('%d of %d' % (t['other'], t['datagrams']) for t in per[2]),
                     ', '.join(str(t['sent'] - t['accepted']) for t in per[1] + per[2])))
    ctx.conditions.append('2c: %d bucketd-sim processes (one source port each, the same '
                          'series) flat out for %g s per trial on the same 2 cores as the '
                          'daemon; trials alternate 1 and 2 loops' % (SENDERS, ctx.step_s))
