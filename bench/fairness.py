"""Row 16a, fairness: legitimate TCP lines beside one hostile sensor sending on its own
connection, as a ratio of the same lines alone (bench/README.md section 16).

Called by suite.py (Suite.hostile_fairness): alternated() runs the daemon alone, beside the
hostile sensor, alone, beside (a fresh daemon each, s.legit_rounds rounds each), so that both
conditions see the same stretch of a shared machine's load, and the figure is the median of
every round of each. The functions take the suite object, whose helpers
(Bucketd, start_sim, run_sim, Load, ...) are passed in as `m`, the suite module, so that this
file imports nothing of it at load time.

Besides the rates, every round records where the time went, so that a ratio below the target
can be told apart from contention for the machine's CPUs:
  - send_s: the legitimate sender's own run (bucketd-sim, start to exit): it has written every
    line into its socket, the daemon may still be reading;
  - drain_s: start until the daemon has read the legitimate socket to the end (the figure);
  - stored_s (stored=True, for diagnosis only): start until the stand-in holds every reading
    of the round. Off in the row: a page's readings may be held back up to flush.max_delay
    (30 s) to save rewrites, so with nothing else flowing a round can take that long to show,
    which says nothing about fairness and would make the row last minutes;
  - per process / thread, from /proc/*/schedstat over the round: time on a CPU and time
    runnable but waiting for one (run-queue wait), for the daemon's threads, the stand-in and
    the hostile sender. A thread that waits on the run queue for most of the round is short of
    CPU, not of bucketd's scheduling;
  - the daemon's counters over the round (/metrics): the hostile connection's pauses, bytes
    read, readings accepted, bulk writes.
"""

import os
import re
import statistics
import subprocess
import time

# The counters sampled around each round (bucketd_<name>_total on /metrics).
COUNTERS = ('tcp_sensor_pauses', 'tcp_congestion_pauses', 'tcp_bytes', 'readings_accepted',
            'bulk_writes', 'readings_flushed')


def schedstat(path):
    """(ns on a CPU, ns runnable waiting for one) of a task, or None when it is gone."""
    try:
        with open(path) as f:
            a = f.read().split()
        return int(a[0]), int(a[1])
    except (OSError, ValueError, IndexError):
        return None


def tasks(pid, label):
    """{label/thread-name: (run_ns, wait_ns)} of every thread of pid."""
    out = {}
    try:
        tids = os.listdir('/proc/%d/task' % pid)
    except OSError:
        return out
    for tid in tids:
        base = '/proc/%d/task/%s' % (pid, tid)
        st = schedstat(base + '/schedstat')
        if st is None:
            continue
        try:
            with open(base + '/comm') as f:
                comm = f.read().strip()
        except OSError:
            comm = tid
        name = '%s/%s' % (label, 'main' if int(tid) == pid else comm)
        # Threads of one name (the driver's) add up.
        prev = out.get(name, (0, 0))
        out[name] = (prev[0] + st[0], prev[1] + st[1])
    return out


def sched_snapshot(procs):
    """procs: [(label, pid)] -> {name: (run_ns, wait_ns)}."""
    snap = {}
    for label, pid in procs:
        if pid is not None:
            snap.update(tasks(pid, label))
    return snap


def sched_delta(a, b):
    return {k: (b[k][0] - a[k][0], b[k][1] - a[k][1]) for k in b if k in a}


def counters(m, mport):
    try:
        _, status, body = m.http_get_timed(mport, '/metrics')
    except OSError:
        return {}
    if status != 200:
        return {}
    text = body.decode('utf-8', 'replace')
    out = {}
    for c in COUNTERS:
        v = m.metric_value(text, 'bucketd_%s_total' % c)
        if v is not None:
            out[c] = v
    return out


# The legitimate sensors' series keys: bucketd-sim sensors 0-9 ("...,sensor=s<n>,...").
LEGIT_ID_RE = re.compile(r'(^|,)sensor=s\d(,|$)')


def legit_stored(coll):
    """Readings the stand-in holds for the legitimate sensors."""
    total = 0
    for doc in coll.find({}, {'sensor_id': 1, 'count': 1}):
        if LEGIT_ID_RE.search(doc.get('sensor_id') or ''):
            total += int(doc.get('count', 0))
    return total


def wait_stored(coll, want, timeout=120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if legit_stored(coll) >= want:
            return True
        time.sleep(0.02)
    return False


def describe_round(p):
    """One round's probe as text: times, the busiest tasks' run/wait, counters."""
    parts = ['send %.0f ms, read %.0f ms' % (1000 * p['send_s'], 1000 * p['drain_s'])]
    if p.get('stored_s') is not None:
        parts[0] += ', stored %.0f ms' % (1000 * p['stored_s'])
    busy = sorted(p['sched'].items(), key=lambda kv: -(kv[1][0] + kv[1][1]))
    for name, (run, wait) in busy:
        if run + wait >= 0.02 * 1e9 * p['drain_s']:
            parts.append('%s run %.0f wait %.0f ms' % (name, run / 1e6, wait / 1e6))
    c = p['counters']
    if c:
        parts.append(', '.join('%s +%d' % (k, v) for k, v in sorted(c.items()) if v))
    return '; '.join(parts)


# The hostile sensor's number in bucketd-sim (--sensor-offset): the legitimate sensors are
# numbers 0-9, and a hostile sensor numbered 0 would be one of them (the same series).
HOSTILE_SENSOR = 1000000


def d_database(name):
    return 'hostile_%s' % name.replace('-', '_')


def describe_note(probes):
    """The rounds' probes of every run ({run name: [probe]}) as one note."""
    parts = []
    for name, ps in probes.items():
        if ps:
            parts.append('%s: %s' % (name, ' | '.join(
                'round %d: %s' % (i + 1, describe_round(p)) for i, p in enumerate(ps))))
    return ('16a, where each round\'s time went (send: the sender\'s own run; read: until the '
            'daemon read the socket to the end, the figure; per task, ms on a CPU and ms runnable waiting for one '
            '(/proc/*/schedstat); the daemon\'s counters over the round): ' + '; '.join(parts))


def legit_run(s, m, name, with_hostile, hostile_rate, hostile_nice=0, probe=True,
              hostile_sensor=HOSTILE_SENSOR, sink='mongodb', stored=False):
    """Rounds of m.LEGIT_LINES legitimate TCP lines (10 sensors, 3 fields) into the stand-in,
    alone or beside one hostile 32-field sensor on its own connection (another listener, from
    s.hostile_lead_s before the first round). Returns (median lines/s, [lines/s of each
    round], final stats, [probe of each round])."""
    port, hport, mport = m.free_port('tcp'), m.free_port('tcp'), m.free_port('tcp')
    standin = s.get_standin() if sink == 'mongodb' else None
    # Two listeners, so that the legitimate connection's socket queue can be watched alone.
    d = m.Bucketd(s, name, [('tcp', port, 'influx'), ('tcp', hport, 'influx')],
                  sink=sink, uri=standin.uri if standin else None, metrics_port=mport if probe else None,
                  database=d_database(name)).start()
    hostile = None
    rates, probes = [], []
    coll = None
    if stored and standin is not None:
        coll = standin.client()[d_database(name)]['buckets']
    try:
        if with_hostile:
            args = [s.bin('bucketd-sim')] + m.Load(1, 32, seed=7, extra=[
                '--sensor-offset', str(hostile_sensor)]).args(
                hport, proto='tcp', rate=hostile_rate, duration=900)
            if hostile_nice:
                args = ['nice', '-n', str(hostile_nice)] + args
            hostile = s.procs.spawn('bucketd-sim hostile', args, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE)
            time.sleep(s.hostile_lead_s)  # the hostile sensor flows first (the scenario)
        # The bench itself too: it starts the sender and polls /proc/net/tcp for the end of the
        # read-out, so its own wait for a CPU is part of every round's time.
        watched = [('bucketd', d.pid), ('standin', standin.proc.pid if standin else None),
                   ('hostile', hostile.pid if hostile is not None else None),
                   ('bench', os.getpid())]
        for r in range(s.legit_rounds):
            c0 = counters(m, mport) if probe else {}
            s0 = sched_snapshot(watched) if probe else {}
            t0 = time.monotonic()
            m.run_sim(s, m.Load(10, 3, seed=3 + r, extra=['--seq', '--seq-start',
                                                         str(r * m.LEGIT_LINES)]).args(
                port, proto='tcp', count=m.LEGIT_LINES), 600)
            t_sent = time.monotonic()
            if not m.wait_tcp_drained(port, timeout=300):
                raise m.BenchError('the legitimate connection was not read to the end')
            t_read = time.monotonic()
            rates.append(m.LEGIT_LINES / (t_read - t0))
            t_stored = None
            if coll is not None:
                if not wait_stored(coll, (r + 1) * m.LEGIT_LINES):
                    raise m.BenchError('the legitimate readings were not stored')
                t_stored = time.monotonic()
            if probe:
                s1 = sched_snapshot(watched)
                c1 = counters(m, mport)
                probes.append({'send_s': t_sent - t0, 'drain_s': t_read - t0,
                               'stored_s': t_stored - t0 if t_stored else None,
                               'sched': sched_delta(s0, s1),
                               'counters': {k: c1[k] - c0.get(k, 0) for k in c1}})
            time.sleep(s.legit_gap_s)
    finally:
        if hostile is not None:
            hostile.terminate()
            try:
                hostile.wait(10)
            except subprocess.TimeoutExpired:
                hostile.kill()
        st = d.stop(timeout=300)
    return statistics.median(rates), rates, st, probes


def alternated(s, m, hostile_rate, runs=2):
    """Row 16a's runs: alone, beside, alone, beside, ... (runs of each, every run a fresh
    daemon with s.legit_rounds rounds), so that both see the same stretch of a shared machine's
    load. Returns (alone rates, beside rates, alone stats, beside stats, {run name: probes}),
    the rates of every round of every run of that kind."""
    alone, beside, st_alone, st_beside, probes = [], [], [], [], {}
    for i in range(runs):
        for kind, with_hostile in (('alone', False), ('beside', True)):
            name = 'legit-%s-%d' % (kind, i + 1)
            _, rates, st, p = legit_run(s, m, name, with_hostile, hostile_rate)
            probes[name] = p
            (beside if with_hostile else alone).extend(rates)
            (st_beside if with_hostile else st_alone).append(st)
    return alone, beside, st_alone, st_beside, probes
