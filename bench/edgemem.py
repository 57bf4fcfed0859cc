"""Row 4 (memory per sensor) of the benchmark suite, and a stand-alone runner for it.

fig_memory(suite) adds the rows for 10 k and 100 k sensors with the default configuration and
1 M sensors with limits.max_sensors and limits.sensor_memory raised: one TCP connection sends
each sensor (the issue's short-named sensors, m,site=s000123, bucketd-sim --short-names; three
fields) three readings, every one of which must be accepted. One more row repeats 100 k with
bucketd-sim's usual, longer ids (m1,sensor=s12345,site=plant-2, a third of them with a third
tag).
The daemon's peak RSS (VmHWM) is reported, with the bytes per sensor above the daemon's size
once ready, and where the resident memory lies at the end (/proc/PID/smaps: the main heap, other
anonymous mappings, files).

Stand-alone (no suite report; prints one line per case):
    python3 bench/edgemem.py --build build [--sensors 10000,100000,1000000] [--long-names]
"""
import argparse
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import suite as S  # noqa: E402  (replaced by the suite's own module when called from it)


def _bind(suite):
    """Use the module the suite object comes from (suite.py may run as __main__)."""
    global S
    S = sys.modules[type(suite).__module__]

DEFAULT_MAX_SENSORS = 100000


def smaps_split(pid):
    """Resident bytes by kind from /proc/PID/smaps: 'heap' (the main arena: the ingest thread's
    sensors), 'anon' (other anonymous mappings: the buffer pool, the thread arenas holding the
    flusher's batches and page accounting, large blocks such as the sensor queues and the
    index; the kernel merges neighbouring ones, so they are not told apart), 'files' (the
    program and its libraries). None if unreadable."""
    out = {'heap': 0, 'anon': 0, 'files': 0}
    kind = None
    try:
        with open('/proc/%d/smaps' % pid) as f:
            for line in f:
                head = line.split(None, 6)
                if '-' in head[0] and not line[0].isupper():
                    name = head[5].strip() if len(head) > 5 else ''
                    kind = ('heap' if name == '[heap]' else
                            'files' if name.startswith('/') else 'anon')
                elif line.startswith('Rss:') and kind:
                    out[kind] += int(line.split()[1]) * 1024
    except OSError:
        return None
    return out


def measure(suite, sensors, per_sensor=3, memory=None, short=True):
    """One daemon, sensors x per_sensor readings: dict of the figures (raises S.BenchError).
    memory: limits.memory if not the default (exploration, not in the report); short: the
    issue's ids (m,site=sNNNNNN), else bucketd-sim's usual ones."""
    _bind(suite)
    raised = sensors > DEFAULT_MAX_SENSORS
    port = S.free_port('tcp')
    d = S.Bucketd(suite, 'edgemem-%d' % sensors, [('tcp', port, 'influx')],
                  max_sensors=sensors if raised else None, memory=memory,
                  sensor_memory='1GiB' if raised else None).start()
    try:
        idle = S.proc_status(d.pid)
        load = S.Load(sensors, suite.fields, extra=['--short-names'] if short else [])
        res = S.run_sim(suite, load.args(port, proto='tcp', count=sensors * per_sensor),
                        max(120, sensors / 1000.0))
        S.wait_tcp_drained(port, timeout=max(30.0, sensors / 5000.0))
        S.time.sleep(1.5)  # at least one flush after the last reading
        peak = S.proc_status(d.pid)
        split = smaps_split(d.pid)
    finally:
        st = d.stop(timeout=max(120.0, sensors / 2000.0))
    if st.get('readings_accepted') != res['readings'] or S.daemon_drops(st):
        raise S.BenchError('%d sensors: accepted %s of %d, drops %s' % (
            sensors, st.get('readings_accepted'), res['readings'], S.daemon_drops(st)))
    hw = S.pool_high_water(d.log())
    return {'sensors': sensors, 'raised': raised, 'idle': idle['VmHWM'], 'hwm': peak['VmHWM'],
            'rss': peak['VmRSS'], 'split': split, 'hw': hw, 'st': st,
            'per': (peak['VmHWM'] - idle['VmHWM']) / sensors,
            'per_total': peak['VmHWM'] / sensors}


def describe(m):
    split = ('; resident after the last flush: main heap %s, other anonymous %s, files %s' %
             tuple(S.mib(m['split'][k]) for k in ('heap', 'anon', 'files')) if m['split'] else '')
    return '%s (%.0f B/sensor above idle, %.0f B/sensor in all); %s%s' % (
        S.mib(m['hwm']), m['per'], m['per_total'], S.describe_pool(m['hw']), split)


def fig_memory(suite):
    """Row 4: appends suite.rows and notes; replaces the suite's own fig_memory."""
    _bind(suite)
    suite.have_sim()
    cases = [(10000, True)] if suite.quick else [(10000, True), (100000, True), (1000000, True),
                                                 (100000, False)]
    for sensors, short in cases:
        figure = '4. memory, %s active sensors (peak RSS, VmHWM%s%s)' % (
            S.si(sensors), '; limits.max_sensors %s, sensor_memory 1GiB' % S.si(sensors)
            if sensors > DEFAULT_MAX_SENSORS else '; default limits',
            '' if short else '; bucketd-sim\'s longer ids')
        try:
            m = measure(suite, sensors, short=short)
        except S.BenchError as e:
            suite.rows.append(S.not_run(figure, e))
            continue
        if sensors >= 100000 and short:
            target, met = '<= 64 MiB', S.met_le(m['hwm'], 64 * S.MIB)
            if sensors > 100000:
                target = '<= 64 MiB (set for 100 k)'
        else:
            target, met = '', ''
        suite.rows.append(S.Row(figure, describe(m), 'idle after start %s' % S.mib(m['idle']),
                                '%.1fx' % (m['hwm'] / m['idle']), target, met))
        suite.note('memory, %s sensors%s: %d readings accepted, flushes %s (%s early for memory), '
                   'VmRSS %s after the last flush' % (
                       S.si(sensors), '' if short else ' (longer ids)',
                       m['st'].get('readings_accepted'), m['st'].get('flushes'),
                       m['st'].get('flushes_for_memory'), S.mib(m['rss'])))
    suite.conditions.append(
        'memory: blackhole sink, default limits (limits.memory 64MiB: a 32 MiB buffer pool '
        'reserved at start, resident only where used; max_sensors 100000; sensor_memory '
        '64MiB), raised to max_sensors 1000000 and sensor_memory 1GiB for the 1 M row; one TCP '
        'connection, 3 readings of 3 fields per sensor (m,site=sNNNNNN; the last row '
        'bucketd-sim\'s ids such as m1,sensor=s12345,site=plant-2), all accepted; VmHWM '
        'read 1.5 s after the last reading; the pool high-water mark is the daemon\'s own, '
        'logged at stop')


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--build', default=os.path.join(HERE, '..', 'build'))
    ap.add_argument('--sensors', default='10000,100000')
    ap.add_argument('--per-sensor', type=int, default=3)
    ap.add_argument('--memory', default=None, help='limits.memory (default: the default)')
    ap.add_argument('--long-names', action='store_true',
                    help="bucketd-sim's usual ids rather than the issue's m,site=sNNNNNN")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix='edgemem-')
    ns = argparse.Namespace(repo=os.path.join(HERE, '..'), build=args.build, work=work,
                            quick=False, only='memory', outage=0.0, writecost=0.0,
                            summary_hours=0)
    suite = S.Suite(ns)
    try:
        for n in [int(x) for x in args.sensors.split(',')]:
            try:
                m = measure(suite, n, args.per_sensor, args.memory, short=not args.long_names)
                print('%d sensors: %s' % (n, describe(m)), flush=True)
            except S.BenchError as e:
                print('%d sensors: not run: %s' % (n, e), flush=True)
    finally:
        suite.procs.stop_all()
    return 0


if __name__ == '__main__':
    sys.exit(main())
