#!/usr/bin/python3
"""Run one peer (rsyslog or syslog-ng) under a load command and measure it.

    run_peer.sh rsyslog|syslog-ng --load-cmd "CMD" [--db NAME] [options]

1. Starts the MongoDB stand-in (tests/mongo_server.py) on a free port, or
   uses $MONGODB_URI.
2. Renders the peer's config (bench/peers/<peer>.conf.in) into a private work
   directory and starts the peer from its unpacked tree (setup.sh) on a free
   UDP port on 127.0.0.1.
3. Waits until the peer is ready: its UDP socket is bound and a probe message
   sent through it has reached the collection (then the probe is deleted), so
   start-up and the first MongoDB connection are not part of the measurement.
4. Runs CMD with bash, with {PORT} replaced by the peer's UDP port and {SENT}
   (if present) by a file path where the load command should write every line
   it sends, one per line (udp_load.py --record {SENT} does).
5. Waits for the peer to drain: the stand-in's write counters
   (serverStatus().opcounters insert + update) must stop growing for
   --quiet seconds.  The counters are polled rather than the collection count
   because a count scans every document in the stand-in; a peer writes one
   document per insert, so both grow in step.
6. Stops the peer and the stand-in and prints ONE JSON line on stdout
   (everything else goes to stderr):

   peer, sent          readings sent: the load command's JSON summary line
                       ("readings"), else the lines in {SENT}
   stored              documents in the collection
   stored_lines        lines in the stored messages (a datagram with several
                       lines is one message, so one document, in both peers)
   intact              sent lines found verbatim as a whole line of a stored
                       message (multiset match: a line sent once counts once);
                       needs {SENT}.  Without it, intact counts distinct
                       stored lines that are well-formed line protocol, and
                       intact_method says "well-formed" instead of "verbatim".
   elapsed_s           from the start of the load command to the last write
                       seen (50 ms polling)
   stored_per_s        stored_lines / elapsed_s
   writes              insert + update operations the stand-in counted during
                       the run (per document / per update statement, as
                       MongoDB counts them); writes_per_reading = writes / sent
   udp_drops           datagrams the kernel dropped on the peer's socket
   peer_cpu_pct, db_cpu_pct   CPU use of the peer and of the stand-in over
                       elapsed_s (100 = one core busy); db_cpu_pct only when
                       the stand-in was started here
   tuning              how the peer was tuned
"""

import argparse
import collections
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import pymongo

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.normpath(os.path.join(HERE, '..', '..'))
MONGO_SERVER = os.path.join(REPO, 'tests', 'mongo_server.py')
ENV_FILE = os.path.join(HERE, '.root', 'env.sh')
PYTHON = '/usr/bin/python3'
PROBE_PREFIX = 'bucketd_peer_probe'
CLK_TCK = os.sysconf('SC_CLK_TCK')
RCVBUF_WANTED = 32 << 20

TUNING = {
    'rsyslog': ('imudp 1 thread, batchSize=256 (recvmmsg), rcvbufSize={rcvbuf}; '
                'ruleset LinkedList queue 250k msgs, dequeueBatchSize=1024, {workers} worker(s); '
                'list template storing rawmsg, control chars not escaped; '
                'ommongodb: 1 insert per message'),
    'syslog-ng': ('network(udp) so-rcvbuf({rcvbuf}), flags(no-parse), threaded(yes); '
                  'log-fifo-size 250k msgs; mongodb() workers({workers}), value-pairs msg=$MESSAGE only; '
                  '1 insert per message (no bulk in 3.38)'),
}


def log(msg):
    sys.stderr.write('run_peer: %s\n' % msg)
    sys.stderr.flush()


# -- helpers -------------------------------------------------------------------

def load_env():
    env = {}
    with open(ENV_FILE) as f:
        for line in f:
            m = re.match(r"^([A-Z_]+)='(.*)'$", line.strip())
            if m:
                env[m.group(1)] = m.group(2)
    return env


def free_udp_port():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(('127.0.0.1', 0))
    port = s.getsockname()[1]
    s.close()
    return port


def udp_socket_state(port):
    """(rx_queue bytes, drops) of the UDP socket bound to 127.0.0.1:port, or None."""
    want = '0100007F:%04X' % port
    try:
        with open('/proc/net/udp') as f:
            next(f)
            for line in f:
                cols = line.split()
                if cols[1] == want:
                    rx = int(cols[4].split(':')[1], 16)
                    return rx, int(cols[-1])
    except OSError:
        pass
    return None


def cpu_seconds(pid):
    try:
        with open('/proc/%d/stat' % pid) as f:
            fields = f.read().rsplit(')', 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK
    except (OSError, IndexError, ValueError):
        return None


def uri_with_db(uri, db):
    """mongodb://hosts[/db][?opts] -> mongodb://hosts/DB[?opts]"""
    m = re.match(r'^(mongodb(?:\+srv)?://[^/?]+)(?:/([^?]*))?(\?.*)?$', uri)
    if not m:
        raise SystemExit('run_peer: cannot parse MongoDB URI %r' % uri)
    return '%s/%s%s' % (m.group(1), db, m.group(3) or '')


def uri_base(uri):
    m = re.match(r'^(mongodb(?:\+srv)?://[^/?]+)(?:/([^?]*))?(\?.*)?$', uri)
    if not m:
        raise SystemExit('run_peer: cannot parse MongoDB URI %r' % uri)
    return '%s/%s' % (m.group(1), m.group(3) or '')


def stop_process(proc, name, timeout=15.0):
    if proc is None or proc.poll() is not None:
        return proc.returncode if proc else None
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        log('%s did not stop within %.0fs of SIGTERM; killing it' % (name, timeout))
        proc.kill()
        return proc.wait()


# Line protocol well-formedness, for when the sent lines are not known:
# measurement[,tag=value...] field=value[,field=value...] [timestamp]
# with backslash escapes and double-quoted string field values.
_INT_RE = re.compile(r'^-?\d+[iu]$')
_FLOAT_RE = re.compile(r'^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$')
_BOOL = {'t', 'T', 'true', 'True', 'TRUE', 'f', 'F', 'false', 'False', 'FALSE'}


def _split_unescaped(s, sep, quotes=False):
    out, cur, i, inq = [], [], 0, False
    while i < len(s):
        c = s[i]
        if c == '\\' and i + 1 < len(s):
            cur.append(s[i:i + 2])
            i += 2
            continue
        if quotes and c == '"':
            inq = not inq
        elif c == sep and not inq:
            out.append(''.join(cur))
            cur = []
            i += 1
            continue
        cur.append(c)
        i += 1
    if inq:
        return None
    out.append(''.join(cur))
    return out


def lp_wellformed(line):
    parts = _split_unescaped(line, ' ', quotes=True)
    if not parts or len(parts) not in (2, 3) or any(p == '' for p in parts):
        return False
    if len(parts) == 3 and not re.match(r'^-?\d+$', parts[2]):
        return False
    series = _split_unescaped(parts[0], ',')
    if not series[0] or any(len(_split_unescaped(t, '=')) != 2 for t in series[1:]):
        return False
    fields = _split_unescaped(parts[1], ',', quotes=True)
    if not fields:
        return False
    for fv in fields:
        kv = _split_unescaped(fv, '=', quotes=True)
        if kv is None or len(kv) != 2 or not kv[0] or not kv[1]:
            return False
        v = kv[1]
        if not (_INT_RE.match(v) or _FLOAT_RE.match(v) or v in _BOOL
                or (len(v) >= 2 and v[0] == '"' and v[-1] == '"')):
            return False
    return True


# -- the MongoDB side -------------------------------------------------------------

class Mongo(object):
    def __init__(self, external_uri, log_path=None):
        self.proc = None
        self._log = None
        if external_uri:
            self.uri = external_uri
            return
        self._log = open(log_path, 'w+b') if log_path else tempfile.TemporaryFile()
        cmd = [PYTHON, MONGO_SERVER] + (['--verbose'] if log_path else [])
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=self._log, close_fds=True)
        deadline = time.monotonic() + 20
        line = b''
        while not line.endswith(b'\n'):
            left = deadline - time.monotonic()
            if left <= 0:
                self.proc.kill()
                raise SystemExit('run_peer: the MongoDB stand-in did not report its port')
            ready, _, _ = select.select([self.proc.stdout], [], [], left)
            if ready:
                chunk = os.read(self.proc.stdout.fileno(), 64)
                if not chunk:
                    raise SystemExit('run_peer: the MongoDB stand-in exited: %s' % self.log_text())
                line += chunk
        self.port = int(line.strip())
        self.uri = 'mongodb://127.0.0.1:%d/' % self.port

    def log_text(self):
        if self._log is None:
            return ''
        self._log.seek(0)
        return self._log.read().decode('utf-8', 'replace')

    def stop(self):
        if self.proc is None:
            return
        rc = stop_process(self.proc, 'the MongoDB stand-in')
        self.proc.stdout.close()
        if rc not in (0, None):
            log('the MongoDB stand-in exited with status %r:\n%s' % (rc, self.log_text()))
        self.proc = None


class WriteWatcher(threading.Thread):
    """Polls serverStatus().opcounters and remembers when the write count last
    changed."""

    def __init__(self, client, interval=0.05):
        super().__init__(daemon=True)
        self.client = client
        self.interval = interval
        self.value = self.read()
        self.changed_at = time.monotonic()
        self.stopping = threading.Event()
        self.lock = threading.Lock()

    def read(self):
        st = self.client.admin.command('serverStatus')
        oc = st.get('opcounters') or {}
        return int(oc.get('insert', 0)) + int(oc.get('update', 0))

    def run(self):
        while not self.stopping.wait(self.interval):
            try:
                v = self.read()
            except pymongo.errors.PyMongoError:
                continue
            now = time.monotonic()
            with self.lock:
                if v != self.value:
                    self.value = v
                    self.changed_at = now

    def snapshot(self):
        with self.lock:
            return self.value, self.changed_at


# -- the peers -----------------------------------------------------------------------

def render(template, values, out_path):
    with open(os.path.join(HERE, template)) as f:
        text = f.read()
    for k, v in values.items():
        text = text.replace('@%s@' % k, str(v))
    left = re.findall(r'@[A-Z_]+@', text)
    if left:
        raise SystemExit('run_peer: unfilled placeholders in %s: %s' % (template, left))
    with open(out_path, 'w') as f:
        f.write(text)


def start_peer(peer, env, work, udp_port, mongo_uri, db, coll, rcvbuf, workers):
    run = os.path.join(work, 'run')
    os.makedirs(run, exist_ok=True)
    penv = dict(os.environ)
    lib = env.get('PEERS_LD_LIBRARY_PATH', '')
    if lib:
        penv['LD_LIBRARY_PATH'] = lib + (':' + penv['LD_LIBRARY_PATH']
                                         if penv.get('LD_LIBRARY_PATH') else '')
    values = {'UDP_PORT': udp_port, 'DB': db, 'COLLECTION': coll, 'WORKDIR': work,
              'RUNDIR': run, 'RCVBUF': rcvbuf, 'WORKERS': workers}
    if peer == 'rsyslog':
        conf = os.path.join(work, 'rsyslog.conf')
        values['MODDIR'] = env['RSYSLOG_MODDIR']
        values['MONGODB_URI'] = uri_base(mongo_uri)
        render('rsyslog.conf.in', values, conf)
        cmd = [env['RSYSLOGD'], '-n', '-f', conf, '-i', os.path.join(run, 'rsyslogd.pid'),
               '-M', env['RSYSLOG_MODDIR']]
    else:
        conf = os.path.join(work, 'syslog-ng.conf')
        values['MODDIR'] = env['SYSLOG_NG_MODDIR']
        values['MONGODB_URI'] = uri_with_db(mongo_uri, db)
        render('syslog-ng.conf.in', values, conf)
        cmd = [env['SYSLOG_NG'], '-F', '-f', conf, '--module-path', env['SYSLOG_NG_MODDIR'],
               '--persist-file', os.path.join(work, 'syslog-ng.persist'),
               '--pidfile', os.path.join(run, 'syslog-ng.pid'),
               '--control', os.path.join(run, 'syslog-ng.ctl')]
    out = open(os.path.join(work, peer + '.out'), 'wb')
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                            env=penv, close_fds=True, cwd=work)
    out.close()
    return proc


def peer_log(work, peer):
    text = []
    for name in (peer + '.out', 'rsyslogd-internal.log', 'syslog-ng-internal.log'):
        p = os.path.join(work, name)
        if os.path.exists(p):
            with open(p, 'rb') as f:
                text.append('--- %s\n%s' % (name, f.read()[-4000:].decode('utf-8', 'replace')))
    return '\n'.join(text)


def wait_ready(proc, peer, work, udp_port, coll, timeout=60.0):
    """Wait for the UDP socket, then push a probe through to MongoDB."""
    deadline = time.monotonic() + timeout
    while udp_socket_state(udp_port) is None:
        if proc.poll() is not None:
            raise SystemExit('run_peer: %s exited with status %r during start-up:\n%s'
                             % (peer, proc.returncode, peer_log(work, peer)))
        if time.monotonic() > deadline:
            raise SystemExit('run_peer: %s did not bind UDP port %d:\n%s'
                             % (peer, udp_port, peer_log(work, peer)))
        time.sleep(0.05)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    probe = ('%s,run=%s ready=1i' % (PROBE_PREFIX, uuid.uuid4().hex)).encode()
    query = {'msg': {'$regex': '^' + PROBE_PREFIX}}
    next_send = 0.0
    while True:
        now = time.monotonic()
        if now >= next_send:
            sock.sendto(probe, ('127.0.0.1', udp_port))
            next_send = now + 5.0
        if coll.find_one(query) is not None:
            break
        if proc.poll() is not None:
            raise SystemExit('run_peer: %s exited with status %r during start-up:\n%s'
                             % (peer, proc.returncode, peer_log(work, peer)))
        if now > deadline:
            raise SystemExit('run_peer: no probe message reached MongoDB through %s within '
                             '%.0fs:\n%s' % (peer, timeout, peer_log(work, peer)))
        time.sleep(0.1)
    sock.close()
    time.sleep(0.5)  # a resent probe may still be on its way
    coll.delete_many(query)


# -- the run -------------------------------------------------------------------------

def parse_summary(stdout):
    for line in reversed(stdout.splitlines()):
        line = line.strip()
        if line.startswith('{') and line.endswith('}'):
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            if isinstance(doc, dict):
                return doc
    return None


def check_intact(messages, sent_path):
    stored_lines = collections.Counter()
    for m in messages:
        for line in m.split('\n'):
            if line != '':
                stored_lines[line] += 1
    n_lines = sum(stored_lines.values())
    if sent_path and os.path.exists(sent_path):
        sent = collections.Counter()
        with open(sent_path, 'rb') as f:
            for raw in f:
                line = raw.rstrip(b'\n').decode('utf-8', 'surrogateescape')
                if line:
                    sent[line] += 1
        intact = sum(min(c, stored_lines.get(line, 0)) for line, c in sent.items())
        return n_lines, intact, 'verbatim', sum(sent.values())
    # Without the sent lines: distinct stored lines that are well-formed line
    # protocol (a duplicated line counts once; a line cut short at a field
    # boundary still looks well-formed, which only "verbatim" can catch).
    intact = sum(1 for line in stored_lines if lp_wellformed(line))
    return n_lines, intact, 'well-formed', None


def _terminate(signum, frame):
    # Unwind through the finally clauses so the peer and the stand-in are
    # stopped too (e.g. under `timeout`).
    raise SystemExit(128 + signum)


def main():
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGHUP, _terminate)
    ap = argparse.ArgumentParser(
        description='Run rsyslog or syslog-ng under a UDP load into MongoDB; print one JSON line.')
    ap.add_argument('peer', choices=('rsyslog', 'syslog-ng'))
    ap.add_argument('--load-cmd', required=True,
                    help='shell command; {PORT} = the peer\'s UDP port, {SENT} = file for the '
                         'lines sent')
    ap.add_argument('--db', help='database (default bench_peers_<peer>)')
    ap.add_argument('--collection', default='messages')
    ap.add_argument('--quiet', type=float, default=2.0,
                    help='seconds without new writes that count as drained (default 2)')
    ap.add_argument('--drain-timeout', type=float, default=600.0,
                    help='give up waiting for the drain after this many seconds')
    ap.add_argument('--workers', type=int, default=1,
                    help='writer threads: rsyslog queue.workerThreads, syslog-ng workers() '
                         '(default 1)')
    ap.add_argument('--db-log', action='store_true',
                    help='run the stand-in with --verbose and keep its log (mongo.log) in the '
                         'work directory (slows it down)')
    ap.add_argument('--keep', action='store_true', help='keep the work directory')
    args = ap.parse_args()

    if not os.path.exists(ENV_FILE):
        log('peers not set up yet; running setup.sh')
        subprocess.check_call(['bash', os.path.join(HERE, 'setup.sh')], stdout=sys.stderr)
    env = load_env()
    db_name = args.db or 'bench_peers_%s' % args.peer.replace('-', '_')
    try:
        rmem_max = int(open('/proc/sys/net/core/rmem_max').read())
    except (OSError, ValueError):
        rmem_max = RCVBUF_WANTED
    # syslog-ng asks with SO_RCVBUF, which the kernel caps at rmem_max;
    # rsyslog (as root) uses SO_RCVBUFFORCE, which is not capped.  Ask both
    # for the same size, one both really get.
    rcvbuf = int(os.environ.get('PEERS_RCVBUF') or min(RCVBUF_WANTED, rmem_max))

    work = tempfile.mkdtemp(prefix='bucketd-peer-%s-' % args.peer)
    mongo = peer = None
    ok = False
    try:
        mongo = Mongo(os.environ.get('MONGODB_URI'),
                      os.path.join(work, 'mongo.log') if args.db_log else None)
        client = pymongo.MongoClient(mongo.uri, serverSelectionTimeoutMS=10000)
        coll = client[db_name][args.collection]
        client.drop_database(db_name)

        udp_port = free_udp_port()
        peer = start_peer(args.peer, env, work, udp_port, mongo.uri, db_name, args.collection,
                          rcvbuf, max(1, args.workers))
        wait_ready(peer, args.peer, work, udp_port, coll)
        log('%s ready on udp/%d, MongoDB %s, database %s' % (args.peer, udp_port, mongo.uri,
                                                            db_name))

        watcher = WriteWatcher(client)
        writes0 = watcher.value
        drops0 = (udp_socket_state(udp_port) or (0, 0))[1]
        sent_path = os.path.join(work, 'sent.txt') if '{SENT}' in args.load_cmd else None
        cmd = args.load_cmd.replace('{PORT}', str(udp_port))
        if sent_path:
            cmd = cmd.replace('{SENT}', sent_path)
        peer_cpu0 = cpu_seconds(peer.pid)
        db_cpu0 = cpu_seconds(mongo.proc.pid) if mongo.proc else None
        watcher.start()
        t0 = time.monotonic()
        log('load: %s' % cmd)
        load = subprocess.run(['bash', '-c', cmd], stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=None)
        t_load_end = time.monotonic()
        stdout = load.stdout.decode('utf-8', 'replace')
        summary = parse_summary(stdout)
        if load.returncode != 0:
            log('the load command exited with status %d' % load.returncode)

        # Drain: no new writes for --quiet seconds.
        while True:
            time.sleep(0.1)
            _, changed = watcher.snapshot()
            now = time.monotonic()
            if now - max(changed, t_load_end) >= args.quiet:
                break
            if now - t_load_end > args.drain_timeout:
                log('still writing %.0fs after the load ended; giving up' % args.drain_timeout)
                break
            if peer.poll() is not None:
                log('%s exited with status %r during the run' % (args.peer, peer.returncode))
                break
        watcher.stopping.set()
        watcher.join()
        writes1, t_last = watcher.snapshot()
        peer_cpu1 = cpu_seconds(peer.pid)
        db_cpu1 = cpu_seconds(mongo.proc.pid) if mongo.proc else None
        state = udp_socket_state(udp_port) or (0, drops0)
        udp_drops = state[1] - drops0
        stop_process(peer, args.peer)

        elapsed = max(t_last - t0, 1e-9) if writes1 != writes0 else None
        messages = [d.get('msg', '') for d in coll.find({}, {'msg': 1, '_id': 0})]
        messages = [m if isinstance(m, str) else str(m) for m in messages
                    if not (isinstance(m, str) and m.startswith(PROBE_PREFIX))]
        stored = len(messages)
        stored_lines, intact, method, recorded = check_intact(messages, sent_path)
        sent = None
        if summary and isinstance(summary.get('readings'), int):
            sent = summary['readings']
        elif recorded is not None:
            sent = recorded
        writes = writes1 - writes0

        def pct(a, b):
            if a is None or b is None or not elapsed:
                return None
            return round(100.0 * (b - a) / elapsed, 1)

        result = collections.OrderedDict([
            ('peer', args.peer),
            ('sent', sent),
            ('stored', stored),
            ('stored_lines', stored_lines),
            ('intact', intact),
            ('intact_method', method),
            ('elapsed_s', round(elapsed, 3) if elapsed else None),
            ('stored_per_s', round(stored_lines / elapsed, 1) if elapsed else None),
            ('writes', writes),
            ('writes_per_reading', round(writes / sent, 4) if sent else None),
            ('lost', (sent - stored_lines) if sent is not None else None),
            ('udp_drops', udp_drops),
            ('load_s', round(t_load_end - t0, 3)),
            ('peer_cpu_pct', pct(peer_cpu0, peer_cpu1)),
            ('db_cpu_pct', pct(db_cpu0, db_cpu1)),
            ('load_rc', load.returncode),
            ('rcvbuf', rcvbuf),
            ('tuning', TUNING[args.peer].format(rcvbuf='%d KiB' % (rcvbuf // 1024),
                                                workers=max(1, args.workers))),
        ])
        sys.stdout.write(json.dumps(result) + '\n')
        sys.stdout.flush()
        ok = True
    finally:
        if peer is not None:
            stop_process(peer, args.peer)
        if mongo is not None:
            mongo.stop()
        if args.keep or args.db_log or not ok:
            log('work directory kept: %s' % work)
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == '__main__':
    main()
