"""Row 17 of bench/suite.py: a reboot during an outage.

1,000 sensors send 10 k readings/s over UDP for the whole run, with the default configuration
(limits.memory and limits.sensor_memory 64 MiB each, flush.interval 1s, spool.sync 1s). After
3 s MongoDB goes away (tests/fault_proxy.py between bucketd and count_proxy closes its
listener); half-way through the outage bucketd is killed with SIGKILL and started again at once
on the same spool.dir, MongoDB still away (every bucket's pages unknown: what it accepts is
spooled unplaced); at the end of the outage MongoDB comes back and the spool is replayed.

Measured: readings lost (accepted by either run and never written; the first run's accepted
count is scraped from /metrics just before the kill), against the documented crash bound (README
"Delivery guarantees": what was accepted in the last flush.max_delay + 2 x flush.interval + the
time a write takes to fail, plus spool.sync, before the kill); peak RSS of each run (VmHWM)
against limits.memory + limits.sensor_memory; the spool's peak bytes; and the replay rate,
into the stand-in (tests/mongo_server.py) and into count_proxy --sink.
"""

import os
import signal
import time

# bench/suite.py, the running one (it runs as __main__): set by fig_reboot.
S = None

RATE = 10000
SENSORS = 1000
# Defaults (config/bucketd.yaml), and the crash bound of README "Delivery guarantees" during an
# outage: 2 x flush.interval + the time a write takes to fail (serverSelectionTimeoutMS, 2 s:
# the proxy refuses connections) + spool.sync. (flush.max_delay only holds pages back while
# MongoDB keeps up.)
LIMITS = (64 << 20) + (64 << 20)
BOUND_S = 2 * 1.0 + 2.0 + 1.0


def sample_rss(pid, peak):
    try:
        st = S.proc_status(pid)
    except (FileNotFoundError, ProcessLookupError):
        return peak
    return max(peak, st.get('VmHWM', 0))


def reboot_run(ctx, target):
    standin = S.StandIn(ctx)
    cp = fp = d = sim = None
    outage = ctx.outage_s
    try:
        cp = S.Proxy(ctx, standin.port, sink=(target == 'sink'))
        cp_t0 = cp.t0
        fp = S.FaultProxy(ctx, cp.port)
        port = S.free_port('udp')
        mport = S.free_port('tcp')
        name = 'reboot-%s-%d' % (target, port)

        def daemon():
            return S.Bucketd(ctx, name, [('udp', port, 'influx')], sink='mongodb',
                             database='bench_reboot', metrics_port=mport,
                             uri='mongodb://127.0.0.1:%d/?directConnection=true' % fp.port)
        d = daemon().start()
        load = S.Load(SENSORS, ctx.fields, seed=23)
        sim = S.start_sim(ctx, load.args(port, rate=RATE, duration=outage + 3600))
        time.sleep(3.0)  # healthy first
        fp.set('unlisten')
        t_out = time.monotonic()
        peak_spool = 0
        hwm = [0, 0]
        while time.monotonic() - t_out < outage / 2:
            hwm[0] = sample_rss(d.pid, hwm[0])
            peak_spool = max(peak_spool, sum(v[0] for v in S.dir_files(d.spool_dir).values()))
            time.sleep(0.5)
        _, _, body = S.http_get_timed(mport, '/metrics')
        accepted1 = S.metric_value(body.decode(), 'bucketd_readings_accepted_total') or 0
        hwm[0] = sample_rss(d.pid, hwm[0])
        t_kill = time.monotonic()
        os.killpg(d.pid, signal.SIGKILL)
        ctx.procs.stop(d.proc, timeout=10)
        os.unlink(d.log_path)  # start() waits for this run's 'ready'
        d = daemon().start()  # the reboot: same spool.dir, MongoDB still away
        t_restarted = time.monotonic()
        while time.monotonic() - t_out < outage:
            hwm[1] = sample_rss(d.pid, hwm[1])
            peak_spool = max(peak_spool, sum(v[0] for v in S.dir_files(d.spool_dir).values()))
            time.sleep(0.5)
        fp.set('pass')
        t_back = time.monotonic()
        t_empty = None
        while time.monotonic() - t_back < max(300.0, 3 * outage):
            hwm[1] = sample_rss(d.pid, hwm[1])
            if S.spool_backlog(d.spool_dir) == 0:
                t_empty = time.monotonic()
                break
            time.sleep(0.2)
        time.sleep(3.0)
        os.killpg(sim.pid, signal.SIGINT)
        # Datagrams sent while no bucketd listened (the reboot) come back refused: expected
        # here, so the sim's status 1 for them alone is not a failure.
        out, err = sim.communicate(timeout=30)
        ctx.procs.wait(sim, 5)
        res = S.last_json(out.decode('utf-8', 'replace'))
        if res is None or 'readings' not in res or (sim.returncode != 0 and (
                res.get('send_errors') or not res.get('refused'))):
            raise S.BenchError('bucketd-sim failed (status %s): %s' % (
                sim.returncode, (err or out).decode('utf-8', 'replace').strip()[-300:]))
        sim = None
        S.wait_rx_drained(port)
        hwm[1] = sample_rss(d.pid, hwm[1])
        st = d.stop()
        d = None
        fp.stop()
        fp = None
        px = cp.stop()
        cp = None
    finally:
        if sim is not None:
            ctx.procs.stop(sim, timeout=5)
        if d is not None:
            d.stop()
        if fp is not None:
            fp.stop()
        if cp is not None:
            cp.stop()
        standin.stop()
    writes = sorted((cp_t0 + w['t'], w['readings']) for w in px.get('writes', [])
                    if w.get('updates'))
    written = sum(n for _, n in writes)
    after = [w for w in writes if w[0] >= t_back]
    replayed = sum(n for t, n in after if t_empty is None or t <= t_empty + 1.0)
    replay_s = (after[-1][0] if t_empty is None else t_empty) - after[0][0] if after else None
    accepted = int(accepted1) + st.get('readings_accepted', 0)
    return {'res': res, 'st': st, 'accepted1': int(accepted1), 'accepted': accepted,
            'written': written, 'lost': accepted - written, 'hwm': hwm,
            'peak_spool': peak_spool, 'replayed': replayed, 'replay_s': replay_s,
            'down_s': t_restarted - t_kill, 't_back': t_back, 't_empty': t_empty}


def fig_reboot(ctx, suite):
    global S
    S = suite
    ctx.have_sim()
    targets = ['sink'] if ctx.quick else ['standin', 'sink']
    outage = ctx.outage_s
    for target in targets:
        what = ('count_proxy --sink' if target == 'sink'
                else 'the stand-in (tests/mongo_server.py)')
        figure = ('17. reboot (SIGKILL, restart) half-way through a %s outage, 1,000 sensors '
                  'at 10 k readings/s, replay into %s' % (
                      '%g min' % (outage / 60) if outage >= 60 else '%g s' % outage, what))
        try:
            r = reboot_run(ctx, target)
        except (S.BenchError, OSError) as e:
            ctx.rows.append(S.not_run(figure, e))
            continue
        st = r['st']
        bound = RATE * BOUND_S
        rate = r['replayed'] / r['replay_s'] if r['replay_s'] else None
        cell = ('lost %d of %d accepted (bound: %d, %g s at the offered rate); peak RSS %s and '
                '%s (run 1, run 2); spool peak %s; replay %s readings/s (%d readings in %.1f s)'
                % (r['lost'], r['accepted'], bound, BOUND_S, S.mib(r['hwm'][0]),
                   S.mib(r['hwm'][1]), S.mib(r['peak_spool']), S.si(rate), r['replayed'],
                   r['replay_s'] or 0))
        met = r['lost'] <= bound and max(r['hwm']) <= LIMITS
        ctx.rows.append(S.Row(figure, cell, 'limits %s' % S.mib(LIMITS), '',
                              'lost <= bound, RSS <= limits', 'yes' if met else 'NO'))
        ctx.note('17, into %s: sent %d (%s datagrams refused while no bucketd listened); run 1 accepted %d (from /metrics before the kill), run 2 '
                 'accepted %s, readings_spooled %s of which unplaced %s, spool_records_placed '
                 '%s, spool_records_replayed %s, spool_dropped_readings %s, drops %s; written '
                 '%d in all; %.1f s between the kill and the restart\'s ready; the spool empty '
                 '%s after MongoDB came back' % (
                     target, r['res']['readings'], r['res'].get('refused'), r['accepted1'], st.get('readings_accepted'),
                     st.get('readings_spooled'), st.get('readings_spooled_unplaced'),
                     st.get('spool_records_placed'), st.get('spool_records_replayed'),
                     st.get('spool_dropped_readings'), S.daemon_drops(st) or 'none',
                     r['written'], r['down_s'],
                     '%.1f s' % (r['t_empty'] - r['t_back']) if r['t_empty'] else 'never'))
    ctx.conditions.append(
        'reboot (row 17): default config, 1,000 sensors x 10 readings/s over UDP for the whole '
        'run; after 3 s tests/fault_proxy.py (between bucketd and count_proxy) closes its '
        'listener for the outage (--outage, %g s in this run); half-way bucketd is SIGKILLed '
        'and started again on the same spool.dir; lost = accepted (run 1 from /metrics just '
        'before the kill, run 2 from its stop) - written (count_proxy); bound = the crash '
        'bound of README "Delivery guarantees" during an outage at the offered rate; RSS = '
        'VmHWM polled every 0.5 s' % outage)
