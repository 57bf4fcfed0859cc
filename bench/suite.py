#!/usr/bin/python3
# -*- coding: utf-8 -*-
"""The benchmark suite proper; bench/run.sh builds the programs and runs this.

    /usr/bin/python3 bench/suite.py --repo DIR --build DIR --work DIR [--quick] [--out FILE]

Runs every figure of DESIGN.md section 7 against binaries in --build, prints one
markdown report (machine and conditions, the table, notes) to stdout and, with
--out, writes the same text to that file.  Progress goes to stderr.

Every process it starts gets its own process group and a pid file under
WORK/pids/; stop_all() (on success, failure, SIGINT or SIGTERM) signals each
group, waits, and kills what is left, and run.sh's trap sweeps the pid files
again should this script itself be killed.  A figure that cannot be measured
prints "not run: <why>" in its row; no number in the report is anything but a
measurement of this run.
"""

import argparse
import calendar
import datetime
import importlib.util
import json
import os
import platform
import random
import re
import select
import signal
import socket
import statistics
import struct
import subprocess
import sys
import time

PYTHON = '/usr/bin/python3'
MIB = 1024 * 1024
HOSTILE_RATE = int(os.environ.get('BENCH_HOSTILE_RATE', '13000'))
# 16a's legitimate lines per round: the 20,000 of the measurement that found the problem (they
# fit in their share of the buffers: the figure is about waiting, not about MongoDB's speed).
LEGIT_LINES = 20000
LEGIT_ROUNDS = 5


def log(msg):
    sys.stderr.write('bench: %s\n' % msg)
    sys.stderr.flush()


class BenchError(Exception):
    pass


# ---------------------------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------------------------

class Procs(object):
    """Children of the suite, each in its own process group, each with a pid file."""

    def __init__(self, piddir):
        self.piddir = piddir
        os.makedirs(piddir, exist_ok=True)
        self.live = {}

    def spawn(self, name, cmd, stdout=subprocess.DEVNULL, stderr=None, env=None, cwd=None):
        p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
                             env=env, cwd=cwd, start_new_session=True, close_fds=True)
        with open(os.path.join(self.piddir, str(p.pid)), 'w') as f:
            f.write(name + '\n')
        self.live[p.pid] = (name, p)
        return p

    def _forget(self, p):
        self.live.pop(p.pid, None)
        try:
            os.unlink(os.path.join(self.piddir, str(p.pid)))
        except FileNotFoundError:
            pass

    def wait(self, p, timeout):
        """Wait for a child to exit on its own; kill its group if it overruns."""
        try:
            rc = p.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop(p, timeout=2)
            raise BenchError('%s did not finish within %.0fs' % (self.name(p), timeout))
        self._signal_group(p, signal.SIGKILL)  # leftovers of a finished leader, if any
        self._forget(p)
        return rc

    def name(self, p):
        return self.live.get(p.pid, ('process %d' % p.pid,))[0]

    def _signal_group(self, p, sig):
        try:
            os.killpg(p.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, p, sig=signal.SIGTERM, timeout=30.0):
        """Signal a child's group, wait for the child, SIGKILL the group on timeout."""
        if p.poll() is None:
            self._signal_group(p, sig)
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                self._signal_group(p, signal.SIGKILL)
                p.wait()
        self._signal_group(p, signal.SIGKILL)
        self._forget(p)
        return p.returncode

    def stop_all(self):
        for _, p in list(self.live.values()):
            if p.poll() is None:
                self._signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + 5
        for _, p in list(self.live.values()):
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            self._signal_group(p, signal.SIGKILL)
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass
            self._forget(p)


def read_json_line(p, timeout, what):
    """The next JSON line a child writes to its stdout pipe (e.g. a ready line)."""
    deadline = time.monotonic() + timeout
    buf = b''
    fd = p.stdout.fileno()
    while True:
        nl = buf.find(b'\n')
        if nl >= 0:
            line = buf[:nl].strip()
            buf = buf[nl + 1:]
            if not line:
                continue
            try:
                return json.loads(line.decode())
            except ValueError:
                return {'raw': line.decode('utf-8', 'replace')}
        left = deadline - time.monotonic()
        if left <= 0:
            raise BenchError('%s: no output within %.0fs' % (what, timeout))
        r, _, _ = select.select([fd], [], [], left)
        if not r:
            continue
        chunk = os.read(fd, 4096)
        if not chunk:
            raise BenchError('%s exited (status %s) before printing its ready line'
                             % (what, p.wait()))
        buf += chunk


def last_json(text):
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith('{'):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


# ---------------------------------------------------------------------------------------------
# Kernel and process facts
# ---------------------------------------------------------------------------------------------

def free_port(kind='tcp'):
    st = socket.SOCK_STREAM if kind == 'tcp' else socket.SOCK_DGRAM
    with socket.socket(socket.AF_INET, st) as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def read_snmp_udp():
    """The Udp: counters of /proc/net/snmp as a dict."""
    with open('/proc/net/snmp') as f:
        rows = [l.split() for l in f if l.startswith('Udp:')]
    return dict(zip(rows[0][1:], (int(v) for v in rows[1][1:])))


def udp_outcome(receiver, rate, res, got, k0, k1, drained, label=''):
    """One UDP trial judged: what bucketd-sim sent (res), what the receiver got (its stop()),
    the kernel's UDP counters before and after (k0, k1) and whether its socket was read out.
    Zero loss is no kernel drop, no drop counted by the receiver, every reading received and
    the socket drained. Logged as one line; returns the trial's dict."""
    kernel = {k: k1.get(k, 0) - k0.get(k, 0) for k in ('RcvbufErrors', 'InErrors')}
    sent = res['readings']
    if receiver == 'sink':
        received = got['lines']
        drops = {'truncated': got['truncated']} if got['truncated'] else {}
    else:
        received = got.get('readings_accepted', 0)
        drops = daemon_drops(got)
    lossless = not any(kernel.values()) and not drops and received == sent and drained
    t = {'rate': rate, 'sent': sent, 'sent_per_s': res['readings_per_s'],
         'elapsed_s': res['elapsed_s'], 'received': received, 'kernel': kernel,
         'drops': drops, 'lossless': lossless, 'datagrams': res.get('datagrams')}
    log('  %s%s rate=%s: sent %d (%s/s) received %d kernel %s drops %s -> %s' % (
        label, receiver, si(rate) if rate else 'flat-out', sent, si(t['sent_per_s']), received,
        kernel, drops or '{}', 'zero loss' if lossless else 'LOSS'))
    return t


def udp_rx_queue(port):
    """Bytes waiting in the receive queue of the UDP socket bound to port (None: no socket)."""
    total = None
    for path in ('/proc/net/udp', '/proc/net/udp6'):
        try:
            with open(path) as f:
                next(f)
                for line in f:
                    parts = line.split()
                    if int(parts[1].rsplit(':', 1)[1], 16) == port:
                        total = (total or 0) + int(parts[4].split(':')[1], 16)
        except (OSError, StopIteration):
            pass
    return total


def wait_rx_drained(port, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        q = udp_rx_queue(port)
        if not q:
            return True
        time.sleep(0.02)
    return False


def tcp_rx_queue(port):
    """Bytes not yet read by the application on the TCP sockets whose local port is port."""
    total = 0
    for path in ('/proc/net/tcp', '/proc/net/tcp6'):
        try:
            with open(path) as f:
                next(f)
                for line in f:
                    parts = line.split()
                    if int(parts[1].rsplit(':', 1)[1], 16) == port:
                        total += int(parts[4].split(':')[1], 16)
        except (OSError, StopIteration):
            pass
    return total


def wait_tcp_drained(port, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if tcp_rx_queue(port) == 0:
            return True
        time.sleep(0.01)
    return False


def cpu_seconds(pid):
    """User + system CPU time of a process (all its threads) so far."""
    return cpu_seconds_path('/proc/%d/stat' % pid)


def thread_cpu(pid):
    """{tid: CPU seconds} of every thread of a process."""
    out = {}
    for tid in os.listdir('/proc/%d/task' % pid):
        try:
            out[int(tid)] = cpu_seconds_path('/proc/%d/task/%s/stat' % (pid, tid))
        except OSError:
            pass
    return out


def cpu_seconds_path(path):
    with open(path) as f:
        fields = f.read().rsplit(')', 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf('SC_CLK_TCK')


def thread_load(pid, before, seconds):
    """Busy share of one core per thread since `before`, main thread first, as text."""
    now = thread_cpu(pid)
    parts = []
    for tid in sorted(now, key=lambda t: (t != pid, -(now[t] - before.get(t, 0.0)))):
        share = (now[tid] - before.get(tid, 0.0)) / seconds
        if tid == pid or share >= 0.01:
            parts.append('%s %.0f%%' % ('main/ingest' if tid == pid else 'thread', 100 * share))
    return ', '.join(parts)


def memory_for(rate, fields):
    """limits.memory (a power of two in MiB, at least the default 64 MiB) whose early-flush
    mark, a quarter of the buffer pool (itself half of limits.memory), holds one second of the
    whole load: a reading takes 1 + fields cells of 16 bytes; a quarter more for the segments'
    partly filled tails."""
    need = 8 * 1.25 * rate * (1 + fields) * 16
    mib_ = 64
    while mib_ * MIB < need:
        mib_ *= 2
    return '%dMiB' % mib_


def pool_high_water(log_text):
    """(in use at most, segments, segment bytes) from the daemon's stop line "buffer pool: at
    most N of M units of B bytes in use at once" (older builds: "segments"), or None."""
    m = None
    for m in re.finditer(r'buffer pool: at most (\d+) of (\d+) (?:segments|units) of (\d+) bytes', log_text):
        pass
    return tuple(int(x) for x in m.groups()) if m else None


def describe_pool(hw):
    if not hw:
        return 'buffer pool high-water not logged'
    used, total, seg = hw
    return 'buffer pool high-water %d of %d units of %d B (%s of the pool, %s)' % (
        used, total, seg, pct(used / total), mib(used * seg))


def io_write_bytes(pid):
    """write_bytes of /proc/PID/io (bytes the process caused to be sent to storage), or None."""
    try:
        with open('/proc/%d/io' % pid) as f:
            for line in f:
                if line.startswith('write_bytes:'):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def dir_files(path):
    """{relative path: (size, mtime_ns)} of the regular files under path."""
    out = {}
    for root, _, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            try:
                st = os.stat(full)
            except OSError:
                continue
            out[os.path.relpath(full, path)] = (st.st_size, st.st_mtime_ns)
    return out


def is_spool_file(name):
    return name.startswith('spool-') or name.startswith('spool.ckpt')


def spool_backlog(path):
    """Bytes of spool records not yet acknowledged, from the checkpoint (saved at least every
    spool.sync interval) and the segments' sizes; None when there is no checkpoint yet."""
    try:
        with open(os.path.join(path, 'spool.ckpt'), 'rb') as f:
            c = f.read(40)
    except OSError:
        c = b''
    segs = {}
    for name in os.listdir(path):
        m = re.match(r'spool-([0-9a-f]{16})\.seg$', name)
        if m:
            try:
                segs[int(m.group(1), 16)] = os.path.getsize(os.path.join(path, name))
            except OSError:
                pass
    if len(c) == 40 and c[:8] == b'BDSPCKPT':
        seg, off = struct.unpack_from('<QQ', c, 16)
    else:
        seg, off = min(segs) if segs else 0, 32
    total = 0
    for no, size in segs.items():
        if no > seg:
            total += max(size - 32, 0)
        elif no == seg:
            total += max(size - off, 0)
    return total


def proc_status(pid):
    out = {}
    with open('/proc/%d/status' % pid) as f:
        for line in f:
            k, _, v = line.partition(':')
            if k in ('VmHWM', 'VmRSS', 'VmPeak', 'VmSize', 'VmData'):
                out[k] = int(v.split()[0]) * 1024
    return out


def parse_stats(text):
    stats = None
    for line in text.splitlines():
        i = line.find('stats: ')
        if i < 0:
            continue
        cur = {}
        for tok in line[i + 7:].split():
            k, eq, v = tok.partition('=')
            if eq and v.isdigit():
                cur[k] = int(v)
        if cur:
            stats = cur
    return stats


def daemon_drops(st):
    """Every counted loss of the daemon's: drop_* reasons, truncation, receive errors."""
    out = {k: v for k, v in st.items() if k.startswith('drop_') and v}
    for k in ('udp_truncated', 'udp_recv_errors', 'readings_lost', 'readings_quarantined'):
        if st.get(k):
            out[k] = st[k]
    return out


# ---------------------------------------------------------------------------------------------
# The daemon
# ---------------------------------------------------------------------------------------------

def yaml_str(s):
    return '"%s"' % str(s).replace('\\', '\\\\').replace('"', '\\"')


class Bucketd(object):
    """One bucketd with a generated config; start() waits for 'ready', stop() returns stats."""

    def __init__(self, ctx, name, listeners, sink='blackhole', uri=None, database=None,
                 flush='1s', memory=None, max_sensors=None, max_delay=None, extra=(),
                 metrics_port=None, tls=None, sensor_memory=None):
        self.ctx = ctx
        self.name = name
        self.listeners = listeners  # [(proto, port, format)]
        self.dir = os.path.join(ctx.work, name)
        # A fresh spool directory for every daemon: what it holds after the run minus what it
        # held once the daemon was ready is what that run wrote there.
        self.spool_dir = os.path.join(self.dir, 'spool')
        os.makedirs(self.spool_dir, exist_ok=True)
        self.cfg_path = os.path.join(self.dir, 'bucketd.yaml')
        self.log_path = os.path.join(self.dir, 'bucketd.log')
        lines = ['writer_id: bench', 'listeners:']
        for proto, port, fmt in listeners:
            lines += ['  - proto: %s' % proto, '    bind: "127.0.0.1:%d"' % port,
                      '    format: %s' % fmt]
            if tls and proto == 'tcp':  # (cert, key) files
                lines += ['    tls:', '      cert: %s' % yaml_str(tls[0]),
                          '      key: %s' % yaml_str(tls[1])]
        lines.append('sink: %s' % sink)
        if sink == 'mongodb':
            lines += ['mongodb:', '  uri: %s' % yaml_str(uri), '  database: %s' % database,
                      '  collection: buckets']
        lines += ['flush:', '  interval: %s' % flush, '  stop_timeout: 60s']
        if max_delay is not None:
            lines.append('  max_delay: %s' % max_delay)
        lines += ['spool:', '  dir: %s' % yaml_str(self.spool_dir),
                  'metrics:', '  bind: "%s"' % (
                      '127.0.0.1:%d' % metrics_port if metrics_port else ''),
                  'log:', '  level: info',
                  # The machine's clock is taken as it is (its kernel may call it
                  # unsynchronised): readings are never held for the clock here.
                  'time:', '  wait_for_sync: 0s']
        limits = []
        if memory:
            limits.append('  memory: %s' % memory)
        if max_sensors:
            limits.append('  max_sensors: %d' % max_sensors)
        if sensor_memory:
            limits.append('  sensor_memory: %s' % sensor_memory)
        if limits:
            lines += ['limits:'] + limits
        lines += list(extra)  # further sections, e.g. ['buckets:', '  max_late: 72h']
        self.config_text = '\n'.join(lines) + '\n'
        self.proc = None
        self.stop_s = None
        self.spool0 = self.spool1 = None  # dir_files() once ready, and after the stop
        self.io0 = self.io1 = None        # write_bytes once ready, and at exit (zombie)

    def log(self):
        try:
            with open(self.log_path, 'rb') as f:
                return f.read().decode('utf-8', 'replace')
        except FileNotFoundError:
            return ''

    def start(self, timeout=30.0):
        with open(self.cfg_path, 'w') as f:
            f.write(self.config_text)
        # The log reaches its file through a pipe and a thread of this process, so that the
        # daemon's own write_bytes (/proc/PID/io) counts no log line.
        import threading
        self.proc = self.ctx.procs.spawn('bucketd ' + self.name,
                                         [self.ctx.bin('bucketd'), '-c', self.cfg_path],
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

        def copy(src, path):
            with open(path, 'wb', buffering=0) as out:
                for chunk in iter(lambda: os.read(src.fileno(), 65536), b''):
                    out.write(chunk)
            src.close()

        self.log_thread = threading.Thread(target=copy, args=(self.proc.stdout, self.log_path),
                                           daemon=True)
        self.log_thread.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if re.search(r'\bready\b', self.log()):
                self.spool0 = dir_files(self.spool_dir)
                self.io0 = io_write_bytes(self.proc.pid)
                return self
            if self.proc.poll() is not None:
                break
            time.sleep(0.02)
        tail = '\n'.join(self.log().splitlines()[-5:])
        self.ctx.procs.stop(self.proc, timeout=5)
        raise BenchError('bucketd (%s) did not become ready: %s' % (self.name, tail))

    @property
    def pid(self):
        return self.proc.pid

    def stop(self, timeout=120.0):
        t0 = time.monotonic()
        # SIGTERM, then wait for the exit without reaping, so that /proc/PID/io can still be
        # read with everything the stop itself wrote; stop() then reaps.
        pid = self.proc.pid
        if self.proc.poll() is None:
            try:
                os.killpg(pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                try:
                    if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT | os.WNOHANG):
                        break
                except ChildProcessError:
                    break
                time.sleep(0.01)
            self.io1 = io_write_bytes(pid)
        rc = self.ctx.procs.stop(self.proc, timeout=timeout)
        self.stop_s = time.monotonic() - t0
        self.log_thread.join(10)  # the last lines (stats) are in the file once it has EOF
        self.spool1 = dir_files(self.spool_dir)
        st = parse_stats(self.log())
        if rc != 0 or st is None:
            tail = '\n'.join(self.log().splitlines()[-5:])
            raise BenchError('bucketd (%s) exited with %s%s: %s' % (
                self.name, rc, '' if st else ' and no stats line', tail))
        return st

    def disk_writes(self):
        """What this daemon wrote under spool.dir between 'ready' and its exit."""
        if self.spool0 is None or self.spool1 is None:
            return None
        a, b = self.spool0, self.spool1
        changed = sorted(n for n in set(a) | set(b) if a.get(n) != b.get(n))
        size = lambda files, pick: sum(v[0] for n, v in files.items() if pick(n))
        return {
            'spool_bytes': size(b, is_spool_file) - size(a, is_spool_file),
            'all_bytes': size(b, lambda n: True) - size(a, lambda n: True),
            'changed': ['%s %s->%s B' % (n, a[n][0] if n in a else '(new)',
                                         b[n][0] if n in b else '(gone)') for n in changed],
            'write_bytes': (self.io1 - self.io0) if self.io0 is not None and
            self.io1 is not None else None,
            'spooled': None}


# ---------------------------------------------------------------------------------------------
# Load, receivers, stand-in
# ---------------------------------------------------------------------------------------------

class Load(object):
    """A bucketd-sim workload (everything but target, rate and length)."""

    def __init__(self, sensors=1000, fields=3, per_datagram=1, max_datagram=None,
                 fmt='influx', seed=1, extra=()):
        self.sensors = sensors
        self.fields = fields
        self.per_datagram = per_datagram
        self.max_datagram = max_datagram
        self.fmt = fmt
        self.seed = seed
        self.extra = list(extra)

    def args(self, port, proto='udp', rate=0, duration=None, count=None, host='127.0.0.1'):
        a = ['--target', '%s:%d' % (host, port), '--proto', proto,
             '--sensors', str(self.sensors), '--fields', str(self.fields),
             '--rate', str(int(rate)), '--format', self.fmt, '--seed', str(self.seed)]
        if proto == 'udp':
            a += ['--per-datagram', str(self.per_datagram)]
            if self.max_datagram:
                a += ['--max-datagram', str(self.max_datagram)]
        if duration is not None:
            a += ['--duration', '%g' % duration]
        if count is not None:
            a += ['--count', str(int(count))]
        return a + self.extra

    def describe(self):
        s = '%d sensors, %d fields, %s' % (self.sensors, self.fields, self.fmt)
        if self.per_datagram > 1:
            s += ', %d readings/datagram (max %s B)' % (self.per_datagram, self.max_datagram)
        return s


def start_sim(ctx, args, name='bucketd-sim'):
    return ctx.procs.spawn(name, [ctx.bin('bucketd-sim')] + args, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE)


def finish_sim(ctx, p, timeout):
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        ctx.procs.stop(p, timeout=2)
        raise BenchError('bucketd-sim did not finish within %.0fs' % timeout)
    ctx.procs.wait(p, 5)
    res = last_json(out.decode('utf-8', 'replace'))
    if p.returncode != 0 or res is None or 'readings' not in res:
        raise BenchError('bucketd-sim failed (status %s): %s' % (
            p.returncode, (err or out).decode('utf-8', 'replace').strip()[-300:]))
    return res


def run_sim(ctx, args, timeout):
    return finish_sim(ctx, start_sim(ctx, args), timeout)


class Sink(object):
    """bench_udp_sink on a port; stop() returns its totals."""

    def __init__(self, ctx, port):
        self.ctx = ctx
        self.proc = ctx.procs.spawn('udp_sink', [ctx.bin('bench_udp_sink'), '--bind',
                                                 '127.0.0.1:%d' % port], stdout=subprocess.PIPE)
        self.ready = read_json_line(self.proc, 10, 'bench_udp_sink')

    def stop(self):
        self.ctx.procs.stop(self.proc, timeout=10)
        res = last_json(self.proc.stdout.read().decode())
        self.proc.stdout.close()
        if res is None:
            raise BenchError('bench_udp_sink printed no totals')
        return res


class StandIn(object):
    """tests/mongo_server.py, the MongoDB stand-in."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.errlog = open(os.path.join(ctx.work, 'mongo_server.log'), 'wb')
        self.proc = ctx.procs.spawn('mongo_server', [PYTHON, os.path.join(
            ctx.repo, 'tests', 'mongo_server.py')], stdout=subprocess.PIPE, stderr=self.errlog)
        deadline = time.monotonic() + 30
        line = b''
        while not line.endswith(b'\n'):
            if time.monotonic() > deadline:
                raise BenchError('mongo_server.py did not print its port')
            r, _, _ = select.select([self.proc.stdout], [], [], 0.5)
            if r:
                chunk = os.read(self.proc.stdout.fileno(), 64)
                if not chunk:
                    raise BenchError('mongo_server.py exited with %s' % self.proc.wait())
                line += chunk
        self.port = int(line.strip())
        self.uri = 'mongodb://127.0.0.1:%d/' % self.port

    def client(self):
        import pymongo
        return pymongo.MongoClient(self.uri, serverSelectionTimeoutMS=10000)

    def stop(self):
        self.ctx.procs.stop(self.proc, timeout=20)
        self.proc.stdout.close()
        self.errlog.close()


class Proxy(object):
    """bench/count_proxy.py in front of a server; sink: it answers update commands itself;
    delay: each update command is held that many seconds; replies: the server's reply to each
    forwarded update and aggregate command is timed."""

    def __init__(self, ctx, target_port, sink=False, delay=0.0, replies=False):
        self.ctx = ctx
        cmd = [PYTHON, os.path.join(ctx.repo, 'bench', 'count_proxy.py'),
               '--target', '127.0.0.1:%d' % target_port, '--writes']
        if replies:
            cmd.append('--replies')
        if sink:
            cmd.append('--sink')
        if delay:
            cmd += ['--delay-writes', '%g' % delay]
        self.proc = ctx.procs.spawn('count_proxy', cmd, stdout=subprocess.PIPE)
        ready = read_json_line(self.proc, 10, 'count_proxy.py')
        self.port = ready['port']
        self.t0 = ready.get('t0')  # its time.monotonic() at start: writes' t are relative

    def stop(self):
        self.ctx.procs.stop(self.proc, timeout=20)
        res = last_json(self.proc.stdout.read().decode())
        self.proc.stdout.close()
        if res is None:
            raise BenchError('count_proxy.py printed no totals')
        return res


class FaultProxy(object):
    """tests/fault_proxy.py in front of a server, switched through its control port."""

    def __init__(self, ctx, target_port, fault='pass'):
        self.ctx = ctx
        self.errlog = open(os.path.join(ctx.work, 'fault_proxy-%d.log' % target_port), 'wb')
        self.proc = ctx.procs.spawn('fault_proxy', [
            PYTHON, os.path.join(ctx.repo, 'tests', 'fault_proxy.py'),
            '--upstream', '127.0.0.1:%d' % target_port, '--fault', fault],
            stdout=subprocess.PIPE, stderr=self.errlog)
        got = {}
        deadline = time.monotonic() + 15
        buf = b''
        while len(got) < 2:
            if time.monotonic() > deadline:
                raise BenchError('fault_proxy.py did not print its ports')
            r, _, _ = select.select([self.proc.stdout], [], [], 0.5)
            if not r:
                continue
            chunk = os.read(self.proc.stdout.fileno(), 256)
            if not chunk:
                raise BenchError('fault_proxy.py exited with %s' % self.proc.wait())
            buf += chunk
            for line in buf.decode().splitlines():
                word, _, addr = line.partition(' ')
                if word in ('listen', 'control') and addr.rpartition(':')[2].isdigit():
                    got[word] = int(addr.rpartition(':')[2])
        self.port = got['listen']
        self.control = got['control']

    def set(self, fault):
        with socket.create_connection(('127.0.0.1', self.control), timeout=10) as c:
            c.sendall((fault + '\n').encode())
            answer = c.makefile().readline().strip()
        if not answer.startswith('ok'):
            raise BenchError('fault_proxy %r: %s' % (fault, answer))
        return answer

    def stop(self):
        self.ctx.procs.stop(self.proc, timeout=10)
        self.proc.stdout.close()
        self.errlog.close()


# ---------------------------------------------------------------------------------------------
# Formatting
# ---------------------------------------------------------------------------------------------

def si(v, unit=''):
    if v is None:
        return 'n/a'
    a = abs(v)
    for div, suf in ((1e9, ' G'), (1e6, ' M'), (1e3, ' k')):
        if a >= div:
            return '%.3g%s%s' % (v / div, suf, unit)
    return '%.3g %s' % (v, unit) if unit else '%.3g' % v


def mib(v):
    return '%.1f MiB' % (v / MIB)


def pct(x):
    """Three significant digits; a share under 1 never shows as 100%."""
    text = '%.3g' % (100.0 * x)
    if x < 1.0 and float(text) >= 100.0:
        text = '99.9'
    return text + '%'



def met_ge(value, target):
    if value is None:
        return 'n/a'
    if value >= target:
        return 'yes'
    return 'no (%s of target)' % pct(value / target)


def met_le(value, limit):
    if value is None:
        return 'n/a'
    if value <= limit:
        return 'yes'
    return 'no (%s of the limit)' % pct(value / limit)


def http_get_timed(port, path, timeout=10.0):
    """One GET on a new connection, as a scraper does (bucketd closes after each response):
    (seconds from connect to the last byte, status, body)."""
    t0 = time.perf_counter()
    with socket.create_connection(('127.0.0.1', port), timeout=timeout) as s:
        s.sendall(b'GET %s HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n' % path.encode())
        chunks = []
        while True:
            c = s.recv(262144)
            if not c:
                break
            chunks.append(c)
    dt = time.perf_counter() - t0
    data = b''.join(chunks)
    head, _, body = data.partition(b'\r\n\r\n')
    m = re.match(rb'HTTP/1\.1 (\d+) ', head)
    return dt, int(m.group(1)) if m else None, body


def metric_value(text, name):
    m = re.search(r'^%s (\S+)$' % re.escape(name), text, re.M)
    return float(m.group(1)) if m else None


class Row(object):
    def __init__(self, figure, bucketd='', baseline='', ratio='', target='', met=''):
        self.cells = [figure, bucketd, baseline, ratio, target, met]


def not_run(figure, why, target=''):
    why = ' '.join(str(why).split())
    if len(why) > 160:
        why = why[:157] + '...'
    return Row(figure, 'not run: %s' % why.replace('|', '/'), '', '', target, 'n/a')


# ---------------------------------------------------------------------------------------------
# The suite
# ---------------------------------------------------------------------------------------------

class Suite(object):

    def __init__(self, args):
        self.repo = os.path.abspath(args.repo)
        self.build = os.path.abspath(args.build)
        self.work = os.path.abspath(args.work)
        self.quick = args.quick
        self.only = set(args.only.split(',')) if args.only else None
        self.procs = Procs(os.path.join(self.work, 'pids'))
        self.rows = []
        self.notes = []
        self.conditions = []
        self.zero_loss_1 = None
        self.standin = None
        self.t_start = time.monotonic()
        q = self.quick
        self.step_s = 0.5 if q else 4.0
        # --quick checks that every part of the suite runs, in under a minute: the rows that
        # take real time by their nature are shortened (2, 8, 9, 13, 14, 16) or, for the write
        # cost row (11: 30 s flush.max_delay and 60 s summaries.interval before its readings
        # show), left out unless asked for by --only or --writecost. The full suite keeps every
        # row and every length.
        self.search_steps = 2 if q else 6
        self.udp_sensors = 1000
        self.wamp_sensors = 20 if q else 100
        self.fields = 3
        # 8: steps of the search into a MongoDB that takes 1 s per bulk write.
        self.slow_step_s = 3.0 if q else 20.0
        self.slow_steps = 1 if q else 5
        # 9: the outage before the replay (--outage; default 10 minutes); with --quick and no
        # --outage it lasts until the spool has held records for 1 s (the daemon spools once a
        # failed write meets the next batch: some 10 s into an outage), at most 60 s. And the
        # live load after the replay.
        self.outage_s = args.outage if args.outage else (60.0 if q else 600.0)
        self.outage_until_spooled = q and not args.outage
        self.replay_settle_s = 0.5 if q else 3.0
        # 10: {group: [disk_writes() of each daemon]} from the healthy-path rows.
        self.disk = {}
        # 11: 1 Hz sensors in real time for --writecost seconds (default 300, --quick 60).
        # 1000 sensors: the Python stand-in takes a bulk of their 1000 updates in about half a
        # second and averages a few percent of a core on this 2-core machine (the notes give
        # both for the run); the sender, also Python, sends 1000 datagrams a second.
        self.writecost_s = args.writecost if args.writecost else (60.0 if q else 300.0)
        self.skip_writecost = q and not args.writecost and not (
            self.only and 'writecost' in self.only)
        self.wc_sensors = 1000
        # 16a: rounds of legitimate lines, alone and beside the hostile sensor, which flows
        # hostile_lead_s before the first round; legit_gap_s between rounds.
        self.legit_rounds = 1 if q else LEGIT_ROUNDS
        self.hostile_lead_s = 1.0 if q else 5.0
        self.legit_gap_s = 0.5 if q else 1.0
        # 12: past hours of one 1 Hz sensor (--summary-hours; default 48, --quick 6).
        self.summary_hours = args.summary_hours if args.summary_hours else (6 if q else 48)

    def record_disk(self, group, d, st):
        w = d.disk_writes()
        if w is None:
            return
        w['spooled'] = st.get('readings_spooled') if st else None
        w['name'] = d.name
        self.disk.setdefault(group, []).append(w)

    def bin(self, name):
        return os.path.join(self.build, name)

    def note(self, text):
        self.notes.append(text)
        log(text)

    def want(self, key):
        return self.only is None or key in self.only

    def have_sim(self):
        if not os.access(self.bin('bucketd-sim'), os.X_OK):
            raise BenchError('%s is missing (tools/bucketd-sim.c not built)' % self.bin(
                'bucketd-sim'))

    # -- 1. parser ------------------------------------------------------------------------
    def fig_loops(self):
        import loops  # bench/loops.py: row 2c
        loops.fig_loops(self)

    def fig_parser(self):
        args = [self.bin('bench_bench_parse')]
        if self.quick:
            args += ['--lines', '50000', '--runs', '2', '--min-time', '0.15']
        p = self.procs.spawn('bench_parse', args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = p.communicate(timeout=300)
        self.procs.wait(p, 5)
        if p.returncode != 0:
            raise BenchError('bench_parse failed: %s' % err.decode().strip()[-200:])
        for line in out.decode().splitlines():
            r = json.loads(line)
            ratio = r['ratio']
            self.rows.append(Row(
                '1. parser, %s (lines/s, 1 core; %d lines, avg %.0f B)' % (
                    r['format'], r['lines'], r['avg_line_bytes']),
                '%s (%.0f ns/line)' % (si(r['parse_lines_per_s']), r['ns_per_line']),
                'memchr split %s' % si(r['memchr_lines_per_s']),
                pct(ratio), '>= 25% of memchr', met_ge(ratio, 0.25)))
            if 'batch_lines_per_s' in r:
                # The daemon's interface: the parser finds the line ends itself.
                bratio = r['batch_ratio']
                self.rows.append(Row(
                    '1. parser, %s, batch (bd_parse_next, as the daemon reads)' % r['format'],
                    '%s (%.0f ns/line)' % (si(r['batch_lines_per_s']), r['batch_ns_per_line']),
                    'memchr split %s' % si(r['memchr_lines_per_s']),
                    pct(bratio), '>= 25% of memchr', met_ge(bratio, 0.25)))
        self.conditions.append('parser: best of %s runs per format, each >= %s s of whole '
                               'passes over the buffer' % (
                                   '2' if self.quick else '7', '0.15' if self.quick else '0.3'))

    # -- 2. UDP ---------------------------------------------------------------------------
    def udp_trial(self, receiver, load, rate):
        port = free_port('udp')
        if receiver == 'sink':
            rx = Sink(self, port)
        else:
            rx = Bucketd(self, 'udp-%d' % port, [('udp', port, load.fmt)]).start()
        try:
            k0 = read_snmp_udp()
            res = run_sim(self, load.args(port, rate=rate, duration=self.step_s),
                          self.step_s + 60)
            drained = wait_rx_drained(port)
            k1 = read_snmp_udp()
        finally:
            got = rx.stop()
        if receiver != 'sink':
            self.record_disk('UDP rows 2a/2b (blackhole sink)', rx, got)
        return udp_outcome(receiver, rate, res, got, k0, k1, drained)

    def udp_search(self, receiver, load):
        """Highest zero-loss rate: flat out first, then bisect on --rate."""
        trials = [self.udp_trial(receiver, load, 0)]
        best = trials[0] if trials[0]['lossless'] else None
        if best is not None:
            # Lossless flat out: the sender is the limit, and its pace varies from run to run
            # on a shared machine; a couple more flat-out runs find its best.
            for _ in range(1 if self.quick else 2):
                t = self.udp_trial(receiver, load, 0)
                trials.append(t)
                if t['lossless'] and t['sent_per_s'] > best['sent_per_s']:
                    best = t
        else:
            # The receiver's own pace under overload bounds what it can take without loss (a
            # little above it: overload itself costs), and just below it is a good first guess.
            recv_rate = trials[0]['received'] / max(trials[0]['elapsed_s'], 1e-9)
            hi = min(trials[0]['sent_per_s'], recv_rate * 1.3)
            lo = 0.0
            guess = min(hi * 0.9, recv_rate * 0.95)
            for _ in range(self.search_steps - 1):
                t = self.udp_trial(receiver, load, guess)
                trials.append(t)
                if t['lossless']:
                    lo = guess
                    if best is None or t['sent_per_s'] > best['sent_per_s']:
                        best = t
                else:
                    hi = guess
                guess = (lo + hi) / 2 if lo > 0 else guess * 0.6
        return best, trials

    def describe_search(self, name, best, trials):
        steps = ', '.join('%s%s' % (si(t['sent_per_s']), '' if t['lossless'] else ' (loss)')
                          for t in trials)
        first_loss = next((t for t in trials if not t['lossless']), None)
        why = ''
        if first_loss is not None:
            parts = ['%s=%d' % kv for kv in first_loss['kernel'].items() if kv[1]]
            parts += ['%s=%d' % kv for kv in first_loss['drops'].items()]
            if first_loss['received'] != first_loss['sent']:
                parts.append('received %d of %d' % (first_loss['received'], first_loss['sent']))
            why = '; loss at flat out: %s' % ', '.join(parts) if trials[0] is first_loss else \
                '; first loss: %s' % ', '.join(parts)
        self.note('%s: tried %s%s' % (name, steps, why))

    def fig_udp(self):
        self.have_sim()
        cases = [
            ('2a. UDP -> blackhole, 1 reading/datagram (readings/s, zero loss)',
             Load(self.udp_sensors, self.fields), 'single'),
            ('2b. UDP -> blackhole, packed (readings/s, zero loss)',
             Load(self.udp_sensors, self.fields, per_datagram=400, max_datagram=60000),
             'packed'),
        ]
        for figure, load, kind in cases:
            try:
                log('%s: kernel ceiling (bench_udp_sink)' % kind)
                sbest, strials = self.udp_search('sink', load)
                log('%s: bucketd' % kind)
                bbest, btrials = self.udp_search('bucketd', load)
            except BenchError as e:
                self.rows.append(not_run(figure, e))
                continue
            self.describe_search('%s sink' % kind, sbest, strials)
            self.describe_search('%s bucketd' % kind, bbest, btrials)
            bval = bbest['sent_per_s'] if bbest else None
            sval = sbest['sent_per_s'] if sbest else None
            bcell = si(bval) if bbest else 'no zero-loss rate found (lowest tried %s)' % si(
                min(t['sent_per_s'] for t in btrials))
            bcell += flat_label(btrials)

            scell = 'bench_udp_sink %s' % (si(sval) if sbest else 'no zero-loss rate found')
            ratio = bval / sval if bval and sval else None
            flat = flat_label(strials)
            if kind == 'single':
                self.zero_loss_1 = bval
                self.rows.append(Row(figure + ' [%s]' % load.describe(), bcell,
                                     scell + flat, pct(ratio) if ratio else 'n/a',
                                     '>= 90% of sink', met_ge(ratio, 0.9)
                                     if ratio is not None else 'no'))
            else:
                self.rows.append(Row(figure + ' [%s]' % load.describe(), bcell,
                                     scell + flat, pct(ratio) if ratio else 'n/a',
                                     '>= 3 M readings/s', met_ge(bval or 0, 3e6)))
        self.conditions.append(
            'UDP search: %g s per step, up to %d steps (flat out, then bisection on --rate); '
            'zero loss = no kernel RcvbufErrors/InErrors, no drop_*/udp_truncated, '
            'received == sent; each step a fresh receiver' % (self.step_s, self.search_steps))
        # Row 2b pinned, the receiver alone on its core (issue 28, item 4): bench/udpfast.py.
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import udpfast
        udpfast.fig_udp_pinned(self, sys.modules[__name__])

    # -- 3. TCP ---------------------------------------------------------------------------
    def fig_tcp(self):
        self.have_sim()
        conns = 3
        dur = 1.5 if self.quick else 5.0
        port = free_port('tcp')
        d = Bucketd(self, 'tcp', [('tcp', port, 'influx')]).start()
        try:
            load = Load(self.udp_sensors, self.fields, extra=['--connections', str(conns)])
            t0 = time.monotonic()
            res = run_sim(self, load.args(port, proto='tcp', duration=dur), dur + 60)
            # The sender is done when its last write is in the kernel; the daemon is done when
            # it has read every byte of it.
            drained = wait_tcp_drained(port)
            t1 = time.monotonic()
        finally:
            st = d.stop()
        sent = res['readings']
        accepted = st.get('readings_accepted', 0)
        rate = accepted / (t1 - t0)
        ok = accepted == sent and not daemon_drops(st) and drained
        self.rows.append(Row(
            '3. TCP -> blackhole, flat out, %d connections (lines/s) [%s]' % (
                conns, load.describe()),
            si(rate) + ('' if ok else ' (accepted %d of %d sent, drops %s)' % (
                accepted, sent, daemon_drops(st))), '', '', '', ''))
        self.note('TCP: %d connections for %g s: %d lines sent (sender %s/s), %d accepted; rate '
                  '= accepted / (sender start -> daemon socket queues empty, %.2f s)' % (
                      conns, dur, sent, si(res['readings_per_s']), accepted, t1 - t0))

    # -- 14. idle TCP connections holding a partial line -----------------------------------
    def idle_conns_at(self, n_conns, max_line, partial_len, sources=16):
        """Memory of a daemon holding n_conns connections, each with a partial line of
        partial_len bytes, from `sources` loopback addresses (max_connections_per_ip is 64 by
        default: 16 x 64 = 1,024). Returns (before, after) proc_status dicts."""
        port = free_port('tcp')
        d = Bucketd(self, 'idle-%d-%d' % (max_line, partial_len), [('tcp', port, 'influx')],
                    extra=['limits:', '  max_line: %d' % max_line]).start()
        socks = []
        try:
            # One connection and line first: what a first connection sets up once is in the
            # baseline.
            w = socket.create_connection(('127.0.0.1', port))
            w.sendall(b'warm v=1\n')
            socks.append(w)
            time.sleep(0.5)
            before = proc_status(d.pid)
            partial = (b'idle,sensor=s0 v=' + b'1' * partial_len)[:partial_len]
            for i in range(n_conns - 1):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                s.bind(('127.0.0.%d' % (2 + i % sources), 0))
                s.connect(('127.0.0.1', port))
                s.sendall(partial)
                socks.append(s)
            # Every byte read by the daemon (socket queues empty), then a few sweeps.
            wait_tcp_drained(port)
            time.sleep(2.5)
            after = proc_status(d.pid)
        finally:
            st = d.stop()
            for s in socks:
                s.close()
        if st.get('tcp_connections') != n_conns:
            raise BenchError('idle connections: %s of %d accepted (tcp_rejected %s, '
                             'tcp_rejected_per_ip %s)' % (
                                 st.get('tcp_connections'), n_conns, st.get('tcp_rejected'),
                                 st.get('tcp_rejected_per_ip', 'n/a')))
        return before, after

    def fig_idleconns(self):
        import resource
        n_conns = 1024
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < n_conns + 256:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, n_conns + 256), hard))
        for max_line, partial_len in ((64 * 1024, 100), (1024 * 1024, 100), (64 * 1024, 16384)):
            figure = ('15. %d idle TCP connections, a %d-byte partial line each, '
                      'limits.max_line %s (memory growth)' % (n_conns, partial_len,
                                                              mib(max_line)))
            if self.quick and (max_line, partial_len) != (64 * 1024, 100):
                self.rows.append(Row(figure, 'not run: --quick', '', '', '', 'n/a'))
                continue
            try:
                before, after = self.idle_conns_at(n_conns, max_line, partial_len)
            except (BenchError, OSError) as e:
                self.rows.append(not_run(figure, e))
                continue
            rss = after['VmRSS'] - before['VmRSS']
            data = after['VmData'] - before['VmData']
            prealloc = n_conns * (max_line + 4096)
            self.rows.append(Row(figure, 'VmRSS +%s, VmData +%s (%.1f KiB per connection)' % (
                mib(rss), mib(data), data / n_conns / 1024.0),
                'buffers preallocated at max_line + 4 KiB: %s' % mib(prealloc),
                '%.3f' % (data / prealloc), '', ''))
            self.note('idle connections, max_line %d, partial lines of %d B: VmRSS %s -> %s, '
                      'VmData %s -> %s' % (max_line, partial_len, mib(before['VmRSS']),
                                           mib(after['VmRSS']), mib(before['VmData']),
                                           mib(after['VmData'])))
        self.conditions.append(
            'idle connections: 1,024 connections from 16 loopback source addresses (64 each, '
            'the default max_connections_per_ip), each sending one partial line and then '
            'nothing; VmRSS and VmData (/proc/PID/status) read after the socket queues are '
            'empty and 2.5 s of idle sweeps, minus the reading after one first connection. '
            'The baseline is what the connections\' buffers would reserve if preallocated at '
            'max_line + 4 KiB each (address space; resident only where written)')

    # -- 4. memory ------------------------------------------------------------------------
    def fig_memory(self):
        # Row 4 (10 k, 100 k with the defaults, 1 M raised, bytes per sensor): bench/edgemem.py.
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import edgemem
        return edgemem.fig_memory(self)

    # -- 5/6. into the stand-in ------------------------------------------------------------
    def get_standin(self):
        if self.standin is None:
            self.standin = StandIn(self)
        return self.standin

    def fig_wamp(self, memory, label):
        """Updates per reading and bytes per reading, through the counting proxy."""
        self.have_sim()
        si_ = self.get_standin()
        sensors = self.wamp_sensors
        per_sensor = 100
        dur = 1.5 if self.quick else 12.0
        proxy = Proxy(self, si_.port)
        port = free_port('udp')
        db = 'bench_wamp_%d' % port
        d = None
        try:
            d = Bucketd(self, 'wamp-%d' % port, [('udp', port, 'influx')], sink='mongodb',
                        uri='mongodb://127.0.0.1:%d/' % proxy.port, database=db,
                        memory=memory).start()
            load = Load(sensors, self.fields, seed=7)
            res = run_sim(self, load.args(port, rate=sensors * per_sensor, duration=dur),
                          dur + 60)
            wait_rx_drained(port)
            st = d.stop()
            self.record_disk('into the stand-in rows 5/6 (1 s flushes)', d, st)
            hw = pool_high_water(d.log())
            d = None
        finally:
            if d is not None:
                d.stop()
            px = proxy.stop()
        flushed = st.get('readings_flushed', 0)
        updates = st.get('updates_sent', 0)
        if not flushed or not updates:
            raise BenchError('nothing flushed (stats %s)' % st)
        drops = daemon_drops(st)
        lossy = st.get('readings_accepted') != res['readings'] or drops or \
            flushed != st.get('readings_accepted')
        rpu = flushed / updates
        steady = steady_state(px.get('writes', []))
        wire = px['c2s_bytes'] / flushed
        in_bytes = res['bytes'] / res['readings']
        extra = '' if not lossy else ' [LOSS: sent %d accepted %s flushed %d %s]' % (
            res['readings'], st.get('readings_accepted'), flushed, drops)
        return {'sensors': sensors, 'rate': sensors * per_sensor, 'dur': dur, 'rpu': rpu,
                'ideal': res['readings_per_s'] / sensors * 1.0,
                'upr': updates / flushed, 'steady': steady, 'wire': wire, 'in_bytes': in_bytes,
                'px': px, 'st': st, 'extra': extra, 'label': label, 'memory': memory, 'hw': hw}

    def fig_into_standin(self):
        results = []
        # The buffer pool wakes the flusher early past a quarter in use: the default 64 MiB
        # never gets there under this load; 2 MiB (a 1 MiB pool, 256 segments to its early-flush
        # mark) does within a flush interval, so the two rows show whether a small
        # limits.memory multiplies the updates.
        for mem, label in ((None, 'default limits.memory 64MiB'),
                           ('2MiB', 'limits.memory 2MiB')):
            figure = '6. updates per reading, %s' % label
            try:
                r = self.fig_wamp(mem, label)
                # The figure only means something at the rate asked for; a sender starved of
                # CPU by a noisy neighbour gets one more chance.
                if r['ideal'] < 99.0 and not self.quick:
                    self.note('into the stand-in (%s): the sender delivered %.1f readings/s per '
                              'sensor instead of 100; measured again' % (label, r['ideal']))
                    r2 = self.fig_wamp(mem, label)
                    r = r2 if r2['ideal'] > r['ideal'] else r
                results.append(r)
            except (BenchError, OSError) as e:
                self.rows.append(not_run(figure, e, '>= 100 readings/update'))
        for r in results:
            steady = (r['steady'] or {}).get('rpu')
            whole = ('%.2f readings/update over the whole run (%.4f updates/reading)' % (
                r['rpu'], r['upr']))
            if steady is not None:
                cell = ('%.2f readings/update in steady state (flushes 2..n-1 of %d); %s, which '
                        'includes the partial first and last flush%s' % (
                            steady, r['steady']['flushes'], whole, r['extra']))
                value = steady
            else:
                cell = whole + r['extra']
                value = r['rpu']
            # The sender paces with a token bucket and may deliver a little less than 100/s per
            # sensor; then one update per sensor per flush carries that little less.
            ideal = r['ideal']
            met = met_ge(value, 100.0)
            if met != 'yes' and ideal < 100.0 and value >= 0.99 * ideal:
                met += ('; that is one update per sensor per flush at the %.2f readings/s per '
                        'sensor the sender delivered' % ideal)
            elif met == 'yes' and r['rpu'] < 100.0:
                met = 'yes in steady state; whole run %s of target' % pct(r['rpu'] / 100.0)
            self.rows.append(Row(
                '6. readings per MongoDB update, 1 s flushes, %d sensors x 100 readings/s, %s'
                % (r['sensors'], r['label']), cell,
                'one update per sensor per flush at the measured send rate: %.2f readings/update'
                % ideal, pct(value / ideal) + ' of that', '>= 100 readings/update', met))
            px = r['px']
            self.note('into the stand-in (%s): %d readings flushed in %d updates, %d bulk '
                      'writes, %s flushes (%s started early for memory); %d bytes '
                      'client->server in %d messages, %d server->client; %d flushes seen on '
                      'the wire; %s' % (
                          r['label'], r['st']['readings_flushed'], r['st']['updates_sent'],
                          r['st'].get('bulk_writes', 0), r['st'].get('flushes'),
                          r['st'].get('flushes_for_memory'), px['c2s_bytes'],
                          px['c2s_messages'], px['s2c_bytes'],
                          (r['steady'] or {}).get('flushes', 0), describe_pool(r['hw'])))
        if results:
            r = results[0]
            self.rows.append(Row(
                '6. bytes on the wire per reading, client->server (%s)' % r['label'],
                '%.1f B/reading (all traffic incl. handshakes)' % r['wire'],
                'line protocol sent to bucketd: %.1f B/reading' % r['in_bytes'],
                '%.2fx' % (r['wire'] / r['in_bytes']), '', ''))
        self.conditions.append(
            'into the stand-in: tests/mongo_server.py (Python, ~thousands of upserts/s), '
            'write concern 1, 1 s flushes, %d readings/s offered over UDP, bytes counted by '
            'bench/count_proxy.py between bucketd and the stand-in' % (self.wamp_sensors * 100))

    def latency_run(self, rate, markers):
        """Markers sent into a running load; the time until each is visible in a find."""
        si_ = self.get_standin()
        sensors = 100
        # Default limits.memory (64 MiB): the early-flush mark, a quarter of its 32 MiB pool,
        # holds more than a second of this load (at most 50 k readings/s of 4 cells, ~3.2 MB).
        port = free_port('udp')
        db = 'bench_latency_%d' % port
        dur = markers * 0.4 + 3
        # flush.max_delay 0: this row measures the flush path itself. With the default hold
        # (30 s) a marker, the only reading of its page, shows up after max_delay + interval.
        d = Bucketd(self, 'latency-%d' % port, [('udp', port, 'influx')], sink='mongodb',
                    uri=si_.uri, database=db, max_delay='0s').start()
        cpu0 = cpu_seconds(si_.proc.pid)
        threads0 = thread_cpu(d.pid)
        t_run0 = time.monotonic()
        sim = None
        lat = []
        try:
            load = Load(sensors, self.fields, seed=11)
            sim = start_sim(self, load.args(port, rate=rate, duration=dur))
            client = si_.client()
            coll = client[db]['buckets']
            coll.find_one({'_id': 'warm-up'})
            time.sleep(1.2)  # past the first flush of the load
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            rnd = random.Random(5)
            pending = {}
            next_send = time.monotonic()
            sent = 0
            deadline = time.monotonic() + dur + 20
            while (sent < markers or pending) and time.monotonic() < deadline:
                now = time.monotonic()
                if sent < markers and now >= next_send:
                    # A new sensor per marker: its bucket's _id is known in advance, and the
                    # stand-in finds an _id without scanning.
                    ts_ns = time.time_ns()
                    sensor = 'bench_marker,m=%d' % sent
                    doc_id = '%s|%d|0' % (sensor, ts_ns // 10**9 // 3600 * 3600)
                    line = '%s seq=%di %d\n' % (sensor, sent, ts_ns)
                    t_sent = time.monotonic()
                    sock.sendto(line.encode(), ('127.0.0.1', port))
                    pending[doc_id] = t_sent
                    sent += 1
                    # Irregular spacing, so markers land at every phase of the flush cycle.
                    next_send = t_sent + rnd.uniform(0.2, 0.45)
                for doc_id, t_sent in list(pending.items()):
                    if coll.find_one({'_id': doc_id}, {'_id': 1}) is not None:
                        lat.append(time.monotonic() - t_sent)
                        del pending[doc_id]
                time.sleep(0.003)
            sock.close()
            client.close()
            res = finish_sim(self, sim, dur + 60)
            sim = None
            db_cpu = (cpu_seconds(si_.proc.pid) - cpu0) / (time.monotonic() - t_run0)
            daemon_cpu = thread_load(d.pid, threads0, time.monotonic() - t_run0)
        finally:
            if sim is not None:
                self.procs.stop(sim, timeout=5)
            st = d.stop()
        self.record_disk('into the stand-in rows 5/6 (1 s flushes)', d, st)
        if len(lat) < markers:
            raise BenchError('only %d of %d markers became visible (at %s readings/s offered: '
                             'accepted %s, flushed %s, drops %s, udp_pauses %s)' % (
                                 len(lat), markers, si(rate), st.get('readings_accepted'),
                                 st.get('readings_flushed'), daemon_drops(st) or 'none',
                                 st.get('udp_pauses')))
        absorbed = (st.get('readings_flushed') == st.get('readings_accepted')
                    and not daemon_drops(st) and d.stop_s < 5.0)
        self.note('flush latency at %s readings/s offered (%s/s sent, %d sensors, default '
                  'limits.memory): accepted %s, flushed %s in %s updates (%s flushes, %s early '
                  'for memory), drops %s, stand-in CPU %.0f%% of a core, bucketd threads (share '
                  'of a core) %s, bucketd stop %.1f s; %s; latencies in ms, in order: %s' % (
                      si(rate), si(res['readings_per_s']), sensors,
                      st.get('readings_accepted'), st.get('readings_flushed'),
                      st.get('updates_sent'), st.get('flushes'), st.get('flushes_for_memory'),
                      daemon_drops(st) or 'none', 100 * db_cpu, daemon_cpu, d.stop_s,
                      describe_pool(pool_high_water(d.log())),
                      ' '.join('%.0f' % (x * 1e3) for x in lat)))
        lat.sort()
        p99 = lat[min(len(lat) - 1, int(round(0.99 * (len(lat) - 1))))]
        return {'median': statistics.median(lat), 'p99': p99, 'n': len(lat),
                'sent_rate': res['readings_per_s'], 'absorbed': absorbed}

    def fig_latency(self):
        self.have_sim()
        if importlib.util.find_spec('pymongo') is None:
            raise BenchError('pymongo is not importable by %s' % PYTHON)
        markers = 2 if self.quick else 20
        light_rate = 5000
        # The stand-in is a Python server whose pace varies threefold between machines of this
        # kind (59% of a core at 277 k readings/s on one, 87% at 143 k on another, where every
        # marker then waited 2-6 s for its writes): past its pace the figure measures the
        # stand-in, not bucketd, so the loaded run is capped at 50 k.
        cap = 50000
        if self.zero_loss_1 and self.zero_loss_1 / 2 <= cap:
            rate = self.zero_loss_1 / 2
            what = 'half the zero-loss rate of 2a'
        elif self.zero_loss_1:
            rate = cap
            what = 'half the zero-loss rate of 2a, capped at %s (the stand-in\'s pace)' % si(cap)
        else:
            rate = 50000
            what = 'a fixed load (2a did not run)'
        runs = [] if self.quick else [('light', light_rate)]
        runs.append(('loaded', rate))
        out = {}
        for name, r in runs:
            out[name] = self.latency_run(r, markers)
        m = out['loaded']
        cell = 'median %.0f ms, p99 %.0f ms (%d markers) at %s readings/s' % (
            m['median'] * 1e3, m['p99'] * 1e3, m['n'], si(m['sent_rate']))
        if not m['absorbed']:
            cell += ' (the stand-in did not keep up: see notes)'
        base = ''
        ratio = ''
        if 'light' in out:
            b = out['light']
            base = 'same at %s readings/s: median %.0f ms, p99 %.0f ms' % (
                si(b['sent_rate']), b['median'] * 1e3, b['p99'] * 1e3)
            ratio = '%.2fx (median)' % (m['median'] / b['median'])
        self.rows.append(Row(
            '5. flush latency into the stand-in, marker sent -> visible in find (1 s flushes, '
            '100 sensors; load = %s)' % what, cell, base, ratio, '', ''))
        self.conditions.append(
            'flush latency: 1 s flushes, flush.max_delay 0 (pages not held back), %d markers per run (p99 of %d is their maximum), each '
            'a reading of a new sensor sent by UDP while bucketd-sim loads 100 sensors; found by '
            'find_one({_id}) polled every ~3 ms; the stand-in absorbs this load because bucketd '
            'sends it one upsert per sensor per flush; its Python update cost is part of the '
            'latency' % (markers, markers))

    # -- 8. UDP into a MongoDB that takes 1 s per bulk ----------------------------------------
    def slow_trial(self, target, rate, standin):
        """One step: a fresh default-config daemon writing through count_proxy, which holds
        every update command 1 s (and with target 'sink' answers it itself)."""
        sensors = 100
        proxy = Proxy(self, standin.port, sink=(target == 'sink'), delay=1.0)
        port = free_port('udp')
        d = None
        try:
            d = Bucketd(self, 'slow-%s-%d' % (target, port), [('udp', port, 'influx')],
                        sink='mongodb', database='bench_slow_%d' % port,
                        uri='mongodb://127.0.0.1:%d/?directConnection=true' % proxy.port).start()
            deadline = time.monotonic() + 20
            while 'indexes ready' not in d.log() and time.monotonic() < deadline:
                time.sleep(0.05)
            load = Load(sensors, self.fields, seed=13)
            k0 = read_snmp_udp()
            cpu0 = cpu_seconds(standin.proc.pid)
            pcpu0 = cpu_seconds(proxy.proc.pid)
            threads0 = thread_cpu(d.pid)
            t0 = time.monotonic()
            res = run_sim(self, load.args(port, rate=rate, duration=self.slow_step_s),
                          self.slow_step_s + 60)
            drained = wait_rx_drained(port)
            k1 = read_snmp_udp()
            wall = time.monotonic() - t0
            db_cpu = (cpu_seconds(standin.proc.pid) - cpu0) / wall
            px_cpu = (cpu_seconds(proxy.proc.pid) - pcpu0) / wall
            daemon_cpu = thread_load(d.pid, threads0, wall)
            st = d.stop()
            self.record_disk('row 8 (UDP into a MongoDB taking 1 s per bulk)', d, st)
            hw = pool_high_water(d.log())
            d = None
        finally:
            if d is not None:
                d.stop()
            px = proxy.stop()
        kernel = {k: k1.get(k, 0) - k0.get(k, 0) for k in ('RcvbufErrors', 'InErrors')}
        sent = res['readings']
        drops = daemon_drops(st)
        accepted = st.get('readings_accepted', 0)
        flushed = st.get('readings_flushed', 0)
        lossless = (not any(kernel.values()) and not drops and accepted == sent and drained
                    and flushed == accepted)
        writes = [w for w in px.get('writes', []) if w.get('updates')]
        gaps = [b['t'] - a['t'] for a, b in zip(writes, writes[1:])]
        # With --sink: from the proxy's answer to the first byte of the next bulk, the time the
        # daemon took to send the next bulk once the previous one was acknowledged.
        turns = [b['t_first'] - a['t_reply'] for a, b in zip(writes, writes[1:])
                 if 't_reply' in a and 't_first' in b]
        t = {'target': target, 'rate': rate, 'sent': sent, 'sent_per_s': res['readings_per_s'],
             'accepted': accepted, 'flushed': flushed, 'kernel': kernel, 'drops': drops,
             'lossless': lossless, 'spooled': st.get('readings_spooled', 0),
             'pauses': st.get('udp_pauses', 0), 'socket_drops': st.get('udp_socket_drops', 0),
             'bulks': len(writes), 'max_bulk': max([w['readings'] for w in writes] or [0]),
             'cycle': statistics.median(gaps) if gaps else None,
             'max_cycle': max(gaps) if gaps else None, 'retries': st.get('bulk_retries', 0),
             'turn': statistics.median(turns) if turns else None,
             'max_turn': max(turns) if turns else None,
             'db_cpu': db_cpu, 'px_cpu': px_cpu, 'daemon_cpu': daemon_cpu, 'hw': hw,
             'stop_s': None}
        log('  1 s/bulk %s rate=%s: sent %d (%s/s) accepted %d flushed %d kernel %s drops %s '
            'spooled %d -> %s' % (target, si(rate), sent, si(t['sent_per_s']), accepted, flushed,
                                  kernel, drops or '{}', t['spooled'],
                                  'zero loss' if lossless else 'LOSS'))
        return t

    def describe_slow(self, t):
        parts = ['%s/s offered %s/s sent' % (si(t['rate']), si(t['sent_per_s'])),
                 'accepted %d of %d, flushed %d' % (t['accepted'], t['sent'], t['flushed']),
                 'kernel drops %s' % (t['kernel'] if any(t['kernel'].values()) else 0),
                 'udp_socket_drops %d' % t['socket_drops'],
                 'daemon drops %s' % (t['drops'] or 'none'),
                 'readings_spooled %d' % t['spooled'], 'udp_pauses %d' % t['pauses'],
                 'bulk_retries %d' % t['retries'],
                 '%d bulks of up to %d readings, one every %s s (median; max %s s)' % (
                     t['bulks'], t['max_bulk'],
                     '%.2f' % t['cycle'] if t['cycle'] else 'n/a',
                     '%.2f' % t['max_cycle'] if t['max_cycle'] else 'n/a'),
                 'acknowledgement -> next bulk\'s first byte %s' % (
                     '%.2f s (median; max %.2f s)' % (t['turn'], t['max_turn'])
                     if t['turn'] is not None else 'n/a'),
                 'CPU: stand-in %.0f%%, count_proxy %.0f%%, bucketd %s' % (
                     100 * t['db_cpu'], 100 * t['px_cpu'], t['daemon_cpu']),
                 describe_pool(t['hw'])]
        return '; '.join(parts) + (' -> zero loss' if t['lossless'] else ' -> LOSS')

    def fig_slowdb(self):
        self.have_sim()
        figure = ('8. UDP -> MongoDB taking 1 s per bulk, default config, highest zero-loss '
                  'readings/s over %g s [100 sensors, 3 fields, 1 reading/datagram]'
                  % self.slow_step_s)
        target = 100000
        standin = self.get_standin()
        # Into the sink: count_proxy answers every update itself after 1 s, so neither the
        # stand-in's Python nor anything but bucketd and the 1 s sets the pace.
        trials = []
        lo, hi = None, None
        rate = target
        for _ in range(self.slow_steps):
            t = self.slow_trial('sink', rate, standin)
            trials.append(t)
            if t['lossless']:
                lo = t
                if t['sent_per_s'] < 0.95 * rate:
                    break  # the sender is the limit: faster asks deliver no more
            else:
                hi = t
            if hi is None:
                rate = rate * 2
            elif lo is None:
                rate = rate / 2
            else:
                rate = (lo['rate'] + hi['rate']) / 2
        for t in trials:
            self.note('8, into count_proxy --sink --delay-writes 1: ' + self.describe_slow(t))
        best = max((t for t in trials if t['lossless']), key=lambda t: t['sent_per_s'],
                   default=None)
        # The same 1 s in front of the stand-in at the target rate: whether the stand-in, not
        # bucketd, is then the limit.
        # (--quick: left out.)
        st_trial = BenchError('--quick') if self.quick else None
        if st_trial is None:
            sfresh = StandIn(self)
            try:
                st_trial = self.slow_trial('standin', target, sfresh)
            except BenchError as e:
                st_trial = e
            finally:
                sfresh.stop()
        if isinstance(st_trial, Exception):
            scell = 'not run: %s' % st_trial
        else:
            self.note('8, into count_proxy --delay-writes 1 -> stand-in: ' +
                      self.describe_slow(st_trial))
            scell = 'into the stand-in behind the same 1 s, at %s/s offered: %s (%s/s sent, ' \
                'stand-in %.0f%% of a core, bulk every %s s)' % (
                    si(target), 'zero loss' if st_trial['lossless'] else 'loss: %s' % (
                        ', '.join(['accepted %d of %d' % (st_trial['accepted'], st_trial['sent'])]
                                  + ['%s=%d' % kv for kv in st_trial['drops'].items()]
                                  + ['flushed %d' % st_trial['flushed']])),
                    si(st_trial['sent_per_s']), 100 * st_trial['db_cpu'],
                    '%.2f' % st_trial['max_cycle'] if st_trial['max_cycle'] else 'n/a')
        if best is not None:
            cell = '%s (spooled %d, udp_pauses %d, pool high-water %s)' % (
                si(best['sent_per_s']), best['spooled'], best['pauses'],
                '%d/%d' % best['hw'][:2] if best['hw'] else 'n/a')
            if best['sent_per_s'] < 0.95 * best['rate']:
                cell += ' (sender-bound: asked %s/s)' % si(best['rate'])
            met = met_ge(best['sent_per_s'], target)
        else:
            cell = 'no zero-loss rate found (lowest tried %s/s)' % si(
                min(t['sent_per_s'] for t in trials))
            met = 'no'
        cell += '; tried ' + ', '.join('%s%s' % (si(t['sent_per_s']), '' if t['lossless']
                                                  else ' (loss)') for t in trials)
        self.rows.append(Row(figure, cell, scell, '', '>= 100 k readings/s', met))
        self.conditions.append(
            '1 s per bulk (row 8): bucketd with its default config (flush.interval 1s, '
            'limits.memory 64MiB, spool on) writing through bench/count_proxy.py '
            '--delay-writes 1, which holds every update command 1 s; --sink: the proxy then '
            'answers it itself (the stand-in serves the handshake and indexes only); zero loss '
            '= no kernel UDP drops, no drop_*, accepted == sent == flushed by the stop; %g s '
            'per step, up to %d steps from 100 k/s (doubling while lossless, then bisecting; '
            'the figure is the rate the sender achieved), 1 reading/datagram' % (
                self.slow_step_s, self.slow_steps))

    # -- 9. replay after an outage -------------------------------------------------------------
    def replay_run(self, target):
        """10 k readings/s over UDP throughout; MongoDB away (fault_proxy unlisten) for
        outage_s; then back: how fast the spool drains."""
        rate, sensors = 10000, 100
        standin = StandIn(self)
        cp = fp = d = sim = None
        try:
            cp = Proxy(self, standin.port, sink=(target == 'sink'))
            cp_t0 = cp.t0
            fp = FaultProxy(self, cp.port)
            port = free_port('udp')
            d = Bucketd(self, 'replay-%s-%d' % (target, port), [('udp', port, 'influx')],
                        sink='mongodb', database='bench_replay',
                        uri='mongodb://127.0.0.1:%d/?directConnection=true' % fp.port).start()
            deadline = time.monotonic() + 20
            while 'indexes ready' not in d.log() and time.monotonic() < deadline:
                time.sleep(0.05)
            load = Load(sensors, self.fields, seed=17)
            k0 = read_snmp_udp()
            sim = start_sim(self, load.args(port, rate=rate, duration=self.outage_s + 3600))
            # Healthy first: the buckets' page look-ups of a fresh daemon done (a batch whose
            # pages are unknown waits in memory, not in the spool).
            time.sleep(3.0)
            fp.set('unlisten')
            t_out = time.monotonic()
            peak = (0, 0)  # (bytes under spool.dir, of which segment files)
            samples = []

            def sample():
                files = dir_files(d.spool_dir)
                tot = sum(v[0] for v in files.values())
                seg = sum(v[0] for n, v in files.items() if n.startswith('spool-'))
                samples.append((time.monotonic(), tot, seg))
                return tot, seg

            t_spooled = None
            while time.monotonic() - t_out < self.outage_s:
                peak = max(peak, sample())
                # The empty spool is one 32-byte segment header.
                if t_spooled is None and samples[-1][2] > 32:
                    t_spooled = samples[-1][0]
                if self.outage_until_spooled and t_spooled is not None and \
                        time.monotonic() - t_spooled >= 1.0:
                    break
                step = 0.2 if self.outage_until_spooled else 1.0
                time.sleep(min(step, max(0.0, self.outage_s - (time.monotonic() - t_out))))
            fp.set('pass')
            t_back = time.monotonic()
            t_empty = None
            limit = max(300.0, 3 * self.outage_s)
            while time.monotonic() - t_back < limit:
                peak = max(peak, sample())
                backlog = spool_backlog(d.spool_dir)
                if backlog == 0:
                    t_empty = time.monotonic()
                    break
                time.sleep(0.2)
            time.sleep(self.replay_settle_s)  # a few live flushes after the replay
            os.killpg(sim.pid, signal.SIGINT)
            res = finish_sim(self, sim, 30)
            sim = None
            drained = wait_rx_drained(port)
            k1 = read_snmp_udp()
            st = d.stop()
            hw = pool_high_water(d.log())
            dlog = d.log()
            d = None
            fp.stop()
            fp = None
            px = cp.stop()
            cp = None
        finally:
            if sim is not None:
                self.procs.stop(sim, timeout=5)
            if d is not None:
                d.stop()
            if fp is not None:
                fp.stop()
            if cp is not None:
                cp.stop()
            standin.stop()
        spooled = st.get('readings_spooled', 0)
        writes = sorted((cp_t0 + w['t'], w['readings']) for w in px.get('writes', [])
                        if w.get('updates'))
        after = [w for w in writes if w[0] >= t_back]
        t_first = after[0][0] if after else None
        cum, t_last, t_end = 0, None, None
        for i, (t, n) in enumerate(after):
            cum += n
            if cum >= spooled:
                t_last = t
                t_end = after[i + 1][0] if i + 1 < len(after) else t
                break
        kernel = {k: k1.get(k, 0) - k0.get(k, 0) for k in ('RcvbufErrors', 'InErrors')}
        return {'target': target, 'spooled': spooled, 'st': st, 'res': res, 'hw': hw,
                'peak_bytes': peak[0], 'peak_seg': peak[1], 't_out': t_out, 't_back': t_back,
                't_empty': t_empty, 't_first': t_first, 't_last': t_last, 't_end': t_end,
                'kernel': kernel, 'drained': drained, 'px': px, 'writes_after': len(after),
                'readings_after': sum(n for _, n in after),
                'reconnect': 'MongoDB writes succeed again' in dlog}

    def fig_replay(self):
        self.have_sim()
        targets = ['sink'] if self.quick else ['standin', 'sink']
        outage = self.outage_s
        for target in targets:
            what = ('count_proxy --sink (answers every update itself)' if target == 'sink'
                    else 'the stand-in (tests/mongo_server.py)')
            figure = ('9. replay from the spool after a %s outage at 10 k readings/s, into %s '
                      '(readings/s while the spool drains)' % (
                          'short (--quick: until the spool held records for 1 s)'
                          if self.outage_until_spooled else
                          '%g min' % (outage / 60) if outage >= 60 else '%g s' % outage, what))
            try:
                r = self.replay_run(target)
            except (BenchError, OSError) as e:
                self.rows.append(not_run(figure, e))
                continue
            if self.outage_until_spooled:
                figure = figure.replace('short', '%.1f s' % (r['t_back'] - r['t_out']), 1)
            st = r['st']
            drops = daemon_drops(st)
            self.note('9, replay into %s: outage %.0f s (fault_proxy unlisten, then pass); '
                      'sent %d (%s/s), accepted %s, flushed %s, readings_spooled %d, '
                      'spool_records_replayed %s, spool_dropped_readings %s, '
                      'spool_write_errors %s, drops %s, kernel %s, udp_pauses %s; %d writes '
                      'carrying %d readings reached count_proxy after the outage; the '
                      'checkpoint showed the spool empty %s after MongoDB came back (spool.sync '
                      '1s: the checkpoint lags up to 1 s); %s' % (
                          target, r['t_back'] - r['t_out'], r['res']['readings'],
                          si(r['res']['readings_per_s']), st.get('readings_accepted'),
                          st.get('readings_flushed'), r['spooled'],
                          st.get('spool_records_replayed'), st.get('spool_dropped_readings'),
                          st.get('spool_write_errors'), drops or 'none', r['kernel'],
                          st.get('udp_pauses'), r['writes_after'], r['readings_after'],
                          '%.1f s' % (r['t_empty'] - r['t_back']) if r['t_empty'] else 'never',
                          describe_pool(r['hw'])))
            if r['t_end'] is None or r['t_first'] is None:
                self.rows.append(Row(figure, 'spool not drained: %d readings spooled; %d '
                                     'writes with %d readings after the outage (see notes)' % (
                                         r['spooled'], r['writes_after'], r['readings_after']),
                                     '', '', '', 'n/a'))
                continue
            replay_s = r['t_end'] - r['t_first']
            rate = r['spooled'] / replay_s if replay_s > 0 else None
            lossless = (not drops and st.get('readings_accepted') == r['res']['readings']
                        and st.get('readings_flushed') == st.get('readings_accepted')
                        and not any(r['kernel'].values()))
            cell = ('%s readings/s (%d spooled readings in %.1f s); spool at its peak %s under '
                    'spool.dir (segments %s); drained %.1f s after MongoDB came back (%.1f s '
                    'to the first write, then %.1f s of replay)%s' % (
                        si(rate), r['spooled'], replay_s, mib(r['peak_bytes']),
                        mib(r['peak_seg']), r['t_end'] - r['t_back'],
                        r['t_first'] - r['t_back'], replay_s,
                        '' if lossless else '; LOSS: sent %d accepted %s flushed %s %s' % (
                            r['res']['readings'], st.get('readings_accepted'),
                            st.get('readings_flushed'), drops or r['kernel'])))
            base = 'live load %s readings/s (%.0fx the replay rate)' % (
                si(r['res']['readings_per_s']), rate / r['res']['readings_per_s']) \
                if rate and r['res'].get('readings_per_s') else ''
            self.rows.append(Row(figure, cell, base, '', '', ''))
        self.conditions.append(
            'replay (row 9): default config, 100 sensors x 100 readings/s over UDP for the '
            'whole run; after 3 s tests/fault_proxy.py (between bucketd and count_proxy) '
            'closes its listener for the outage (--outage, %s in this run), then passes '
            'again, and the load goes on %g s after the spool is empty; replay rate = readings_spooled / (first write after the outage -> the '
            'write after the one that completes the spooled count, as count_proxy saw them: '
            'the spool is replayed before any live batch); peak = bytes of the files under '
            'spool.dir, polled every second; drained = that end, from the moment MongoDB came '
            'back%s' % ('until the spool held records for 1 s, at most %g s (--quick)' % outage
                        if self.outage_until_spooled else '%g s' % outage,
                        self.replay_settle_s,
                        '; --quick: into the sink only' if self.quick else ''))

    # -- 17. reboot during an outage (bench/reboot.py) ------------------------------------------
    def fig_reboot(self):
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import reboot
        reboot.fig_reboot(self, sys.modules[__name__])

    # -- 7. peers ---------------------------------------------------------------------------
    def peer_load(self):
        """The one load every contender gets: a burst of UDP readings with unique seq fields."""
        # 140k messages: the peers' result check reads every stored message back, and the
        # stand-in cannot return much more than that in one cursor reply (16 MB).
        count = 140000
        rate = 200000
        sensors = 100
        cmd = ('%s --target 127.0.0.1:{PORT} --proto udp --sensors %d --fields %d --seq '
               '--rate %d --count %d --seed 3 --record {SENT} --quiet' % (
                   self.bin('bucketd-sim'), sensors, self.fields, rate, count))
        return cmd, sensors, rate, count

    def run_peer(self, peer, cmd):
        script = os.path.join(self.repo, 'bench', 'peers', 'run_peer.sh')
        errpath = os.path.join(self.work, 'peer-%s.log' % peer)
        with open(errpath, 'wb') as err:
            p = self.procs.spawn('run_peer %s' % peer, ['bash', script, peer, '--load-cmd', cmd],
                                 stdout=subprocess.PIPE, stderr=err)
            try:
                out, _ = p.communicate(timeout=900)
            except subprocess.TimeoutExpired:
                self.procs.stop(p, timeout=10)
                raise BenchError('run_peer.sh %s did not finish within 900 s' % peer)
        self.procs.wait(p, 5)
        res = last_json(out.decode('utf-8', 'replace'))
        if p.returncode != 0 or res is None or 'stored_per_s' not in res:
            with open(errpath, 'rb') as f:
                tail = f.read().decode('utf-8', 'replace').strip().splitlines()[-1:]
            raise BenchError('run_peer.sh %s failed (status %s): %s' % (
                peer, p.returncode, tail[0] if tail else 'no output'))
        return res

    def bucketd_like_peer(self, cmd, sensors, rate):
        """bucketd under the peers' load, measured the way run_peer.py measures a peer: a fresh
        stand-in, elapsed from the start of the load to the last write the stand-in counted
        (serverStatus opcounters polled every 50 ms, drained after 2 s without writes)."""
        import pymongo
        import threading
        standin = StandIn(self)
        d = None
        try:
            port = free_port('udp')
            db = 'bench_peers_bucketd'
            # Tuned like the peers' queues: the buffer pool's early-flush mark holds a flush
            # interval's worth of the load (1 + fields cells per reading).
            memory = memory_for(rate, self.fields + 1)  # + 1: the seq field
            d = Bucketd(self, 'peers-bucketd', [('udp', port, 'influx')], sink='mongodb',
                        uri=standin.uri, database=db, memory=memory).start()
            client = standin.client()
            deadline = time.monotonic() + 20
            while 'indexes ready' not in d.log() and time.monotonic() < deadline:
                time.sleep(0.05)

            def writes():
                oc = client.admin.command('serverStatus').get('opcounters') or {}
                return int(oc.get('insert', 0)) + int(oc.get('update', 0))

            state = {'value': writes(), 'changed': time.monotonic()}
            writes0 = state['value']
            stop = threading.Event()

            def watch():
                while not stop.wait(0.05):
                    try:
                        v = writes()
                    except pymongo.errors.PyMongoError:
                        continue
                    if v != state['value']:
                        state['value'] = v
                        state['changed'] = time.monotonic()

            th = threading.Thread(target=watch, daemon=True)
            th.start()
            sent_path = os.path.join(self.work, 'peers-bucketd-sent-%d.txt' % port)
            t0 = time.monotonic()
            load = self.procs.spawn('peer load', [
                'bash', '-c', cmd.replace('{PORT}', str(port)).replace('{SENT}', sent_path)],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            out, err = load.communicate(timeout=300)
            self.procs.wait(load, 5)
            t_load_end = time.monotonic()
            summary = last_json(out.decode('utf-8', 'replace'))
            if load.returncode != 0 or not summary:
                raise BenchError('load command failed: %s' % err.decode()[-200:])
            # Done when the stand-in has taken a write and then none for 3 s. Without the first
            # condition a stand-in slower than a flush interval plus 2 s (one bulk of the whole
            # burst) was given up on before its write landed, and the run measured nothing.
            while (state['value'] == writes0 or
                   time.monotonic() - max(state['changed'], t_load_end) < 3.0):
                time.sleep(0.1)
                if time.monotonic() - t_load_end > 600:
                    break
            stop.set()
            th.join()
            elapsed = state['changed'] - t0
            n_writes = state['value'] - writes0
            st = d.stop()
            d = None
            # Intact: a stored reading equal to a line the simulator recorded as sent (sensor
            # id, timestamp to the millisecond, every field with its value and type), each
            # line counted once; the peers' text is compared verbatim the same way.
            sent_lines = parse_recorded(sent_path)
            seen = set()
            stored = intact = 0
            coll = client[db]['buckets']
            for doc in coll.find({}, {'sensor_id': 1, 'readings': 1}).batch_size(20):
                for r in doc.get('readings', []):
                    stored += 1
                    seq = r.get('seq')
                    want = sent_lines.get(seq) if isinstance(seq, int) else None
                    if want is None or seq in seen:
                        continue
                    key, ts_ms, fields = want
                    got = {k: v for k, v in r.items() if k != 'ts'}
                    if doc.get('sensor_id') == key and dt_ms(r.get('ts')) == ts_ms and \
                            same_values(got, fields):
                        seen.add(seq)
                        intact += 1
            client.close()
        finally:
            if d is not None:
                d.stop()
            standin.stop()
        sent = summary['readings']
        return {'peer': 'bucketd', 'sent': sent, 'stored': stored, 'intact': intact,
                'elapsed_s': elapsed, 'stored_per_s': stored / elapsed if elapsed > 0 else None,
                'intact_per_s': intact / elapsed if elapsed > 0 else None,
                'writes': n_writes, 'writes_per_reading': n_writes / sent if sent else None,
                'memory': memory, 'stats': st, 'load_s': t_load_end - t0}

    def fig_peers(self):
        figure = '7. peers: readings/s stored intact'
        script = os.path.join(self.repo, 'bench', 'peers', 'run_peer.sh')
        if not os.access(script, os.R_OK):
            self.rows.append(not_run(figure, 'bench/peers/run_peer.sh is not there',
                                     '>= 10x each peer'))
            return
        self.have_sim()
        cmd, sensors, rate, count = self.peer_load()
        shown = cmd.replace(self.build + '/', '')
        # bucketd finishes such a burst within about a flush interval, so where the load starts
        # in its flush cycle matters: three runs, the median counts. They are spread before,
        # between and after the peers' runs so that all see the same spells of machine noise.
        bruns = []
        presults = {}

        def bucketd_run():
            b = self.bucketd_like_peer(cmd, sensors, rate)
            bruns.append(b)
            self.note('peers, bucketd run %d: sent %d, stored %d, intact %d in %.2f s (load '
                      '%.2f s) = %s/s, %d stand-in writes; limits.memory %s; drops %s' % (
                          len(bruns), b['sent'], b['stored'], b['intact'], b['elapsed_s'],
                          b['load_s'], si(b['intact_per_s']), b['writes'], b['memory'],
                          daemon_drops(b['stats']) or 'none'))

        try:
            bucketd_run()
            for peer in ('rsyslog', 'syslog-ng'):
                try:
                    presults[peer] = self.run_peer(peer, cmd)
                except (BenchError, OSError) as e:
                    presults[peer] = e
                bucketd_run()
        except (BenchError, OSError, ImportError) as e:
            self.rows.append(not_run('7. peers: bucketd into the stand-in', e,
                                     '>= 10x each peer'))
            return
        b = sorted(bruns, key=lambda x: x['intact_per_s'] or 0)[len(bruns) // 2]
        bval = b['intact_per_s']
        for peer in ('rsyslog', 'syslog-ng'):
            row = '7. peers: %s vs bucketd, readings/s stored intact' % peer
            r = presults[peer]
            if isinstance(r, Exception):
                self.rows.append(not_run(row, r, '>= 10x'))
                continue
            pval = r['intact'] / r['elapsed_s'] if r.get('elapsed_s') else None
            ratio = bval / pval if bval and pval else None
            self.rows.append(Row(
                row, '%s (median of %d; %d of %d intact; %.4f writes/reading)' % (
                    si(bval), len(bruns), b['intact'], b['sent'], b['writes_per_reading']),
                '%s %s (%d of %d intact, %s; %.3f writes/reading)' % (
                    peer, si(pval), r['intact'], r['sent'], r.get('intact_method'),
                    r['writes_per_reading']),
                '%.1fx' % ratio if ratio else 'n/a', '>= 10x',
                met_ge(ratio, 10.0) if ratio is not None else 'n/a'))
            self.note('peers, %s: sent %s, stored %s, intact %s (%s) in %s s, udp_drops %s, '
                      'peer CPU %s%%, stand-in CPU %s%%; tuning: %s' % (
                          peer, r.get('sent'), r.get('stored_lines'), r.get('intact'),
                          r.get('intact_method'), r.get('elapsed_s'), r.get('udp_drops'),
                          r.get('peer_cpu_pct'), r.get('db_cpu_pct'), r.get('tuning')))
        self.conditions.append(
            'peers: the same load for all three, `%s`, into a fresh stand-in each; readings/s '
            '= intact readings (equal to a recorded sent line) / (load start -> last write the '
            'stand-in counted); bucketd '
            'tuned like the peers\' queues (limits.memory %s: the early-flush mark, a quarter '
            'of its buffer pool, holds 1 s of the load)' % (shown, b['memory']))

    # -- 11. write cost and visibility of 1 Hz sensors -----------------------------------------
    def fig_writecost(self):
        """N sensors x 1 reading/s in real time into a default-config daemon and a fresh
        stand-in: the stand-in's document bytes written by updates against what is stored, the
        model that extrapolates it to an hour, and the delay until marked readings show in
        their page and in their summary document."""
        if importlib.util.find_spec('pymongo') is None:
            raise BenchError('pymongo is not importable by %s' % PYTHON)
        import threading
        import bson
        from bson.codec_options import CodecOptions
        from bson.raw_bson import RawBSONDocument
        sensors = self.wc_sensors
        dur = int(self.writecost_s)
        mark_every = 20
        poll = 0.1
        # The defaults this row measures (config/bucketd.yaml), which the daemon runs with.
        max_delay, interval, sum_interval, max_readings = 30.0, 1.0, 60.0, 1000
        max_future_s = 600  # buckets.max_future: the look-up horizon's distance from the start
        # A 1 Hz page's oldest pending reading, drained at a flush, is due max_delay later, at
        # a flush: each update carries the readings of max_delay / interval + 1 flushes.
        per_update = int(max_delay / interval) + 1
        db_name = 'bench_writecost'
        marker_sensor = 'wc,s=0'
        standin = StandIn(self)  # fresh: its write counters, CPU and memory are this row's
        proxy = d = sender = None
        stop_send = threading.Event()
        lock = threading.Lock()
        counts = {}   # (sensor, bucket start s) -> readings sent
        markers = []  # marked readings of marker_sensor
        sent = {'n': 0, 't0': None, 't1': None, 'late_s': 0.0}
        try:
            # count_proxy times each bulk write and summary refresh (request -> server reply).
            proxy = Proxy(self, standin.port, replies=True)
            px_t0 = proxy.t0
            port = free_port('udp')
            d = Bucketd(self, 'writecost', [('udp', port, 'influx')], sink='mongodb',
                        uri='mongodb://127.0.0.1:%d/?directConnection=true' % proxy.port,
                        database=db_name).start()
            ready_s = time.time()
            deadline = time.monotonic() + 20
            while 'indexes ready' not in d.log() and time.monotonic() < deadline:
                time.sleep(0.05)
            client = standin.client()
            db = client[db_name]
            pages = db['buckets']
            sums = db['buckets_summary']
            pages.find_one({'_id': 'warm-up'})
            cpu0 = cpu_seconds(standin.proc.pid)
            threads0 = thread_cpu(d.pid)
            t_run0 = time.monotonic()

            def send():
                # One datagram per reading, every sensor once a second, timestamps "now" (whole
                # milliseconds, what a BSON date keeps); a marker every mark_every seconds from
                # marker_sensor: f0 = 1e6 + its number (other readings' f0 is below 100).
                rnd = random.Random(23)
                sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                t0 = time.monotonic()
                sent['t0'] = t0
                try:
                    for s in range(dur):
                        wait = t0 + s - time.monotonic()
                        if wait > 0 and stop_send.wait(wait):
                            return
                        sent['late_s'] = max(sent['late_s'], -wait)
                        for i in range(sensors):
                            ts_ms = time.time_ns() // 10**6
                            bucket = ts_ms // 1000 // 3600 * 3600
                            pos = counts.get((i, bucket), 0)
                            mark = i == 0 and s % mark_every == mark_every // 4
                            f0 = 1e6 + len(markers) if mark else rnd.uniform(0, 100)
                            line = 'wc,s=%d f0=%.2f,f1=%di %d\n' % (
                                i, f0, rnd.randint(0, 1000), ts_ms * 10**6)
                            t_sent = time.monotonic()
                            sock.sendto(line.encode(), ('127.0.0.1', port))
                            counts[(i, bucket)] = pos + 1
                            sent['n'] += 1
                            if mark:
                                with lock:
                                    markers.append({
                                        'no': len(markers), 't_sent': t_sent, 'ts_ms': ts_ms,
                                        'f0': float('%.2f' % f0), 'bucket': bucket, 'pos': pos,
                                        'page_id': '%s|%d|%d' % (marker_sensor, bucket,
                                                                 pos // max_readings)})
                finally:
                    sent['t1'] = time.monotonic()
                    sock.close()

            sender = threading.Thread(target=send, daemon=True)
            sender.start()
            # Poll while markers wait: the page by its _id (the stand-in finds an _id without a
            # scan), the summary by {sensor_id, bucket_start}; a marker is visible once the
            # document's count passes its position (readings arrive in order, one writer).
            taken = 0
            pend_page, pend_sum = [], []
            grace = max_delay + interval + sum_interval + 60.0
            while True:
                with lock:
                    new = markers[taken:]
                    taken = len(markers)
                pend_page += new
                pend_sum += new
                for pid in sorted(set(m['page_id'] for m in pend_page)):
                    doc = pages.find_one({'_id': pid}, {'count': 1})
                    t_seen = time.monotonic()
                    for m in [m for m in pend_page if m['page_id'] == pid]:
                        if doc is not None and doc.get('count', 0) > m['pos'] % max_readings:
                            m['page_s'] = t_seen - m['t_sent']
                            pend_page.remove(m)
                for b in sorted(set(m['bucket'] for m in pend_sum)):
                    doc = sums.find_one({'sensor_id': marker_sensor, 'bucket_start':
                                         datetime.datetime(1970, 1, 1) +
                                         datetime.timedelta(seconds=b)}, {'count': 1})
                    t_seen = time.monotonic()
                    for m in [m for m in pend_sum if m['bucket'] == b]:
                        if doc is not None and doc.get('count', 0) > m['pos']:
                            m['sum_s'] = t_seen - m['t_sent']
                            pend_sum.remove(m)
                if not sender.is_alive():
                    if not pend_page and not pend_sum:
                        break
                    if time.monotonic() - sent['t1'] > grace:
                        break
                time.sleep(poll)
            t_quiet = time.monotonic()
            wall = t_quiet - t_run0
            db_cpu = (cpu_seconds(standin.proc.pid) - cpu0) / wall
            daemon_cpu = thread_load(d.pid, threads0, wall)
            st = d.stop()
            d_stop = d.stop_s
            hw = pool_high_water(d.log())
            d = None
            px = proxy.stop()
            proxy = None
            standin_mem = proc_status(standin.proc.pid)
            wstats = db.command('bucketdTestStats', 'buckets')
            sstats = db.command('bucketdTestStats', 'buckets_summary')
            raw = CodecOptions(document_class=RawBSONDocument)
            stored = [(len(r.raw), bson.decode(r.raw)) for r in
                      pages.with_options(codec_options=raw).find({})]
            sdocs = [len(r.raw) for r in sums.with_options(codec_options=raw).find({})]
            client.close()
        finally:
            stop_send.set()
            if sender is not None:
                sender.join(5)
            if d is not None:
                d.stop()
            if proxy is not None:
                proxy.stop()
            standin.stop()

        # -- checks: everything sent was stored, marked readings where they were looked for
        n_sent = sent['n']
        drops = daemon_drops(st)
        problems = []
        if st.get('readings_accepted') != n_sent or st.get('readings_flushed') != n_sent or drops:
            problems.append('sent %d, accepted %s, flushed %s, drops %s' % (
                n_sent, st.get('readings_accepted'), st.get('readings_flushed'),
                drops or 'none'))
        if st.get('summary_refresh_errors') or st.get('summary_buckets_skipped'):
            problems.append('summary_refresh_errors %s, summary_buckets_skipped %s' % (
                st.get('summary_refresh_errors'), st.get('summary_buckets_skipped')))
        by_id = {doc['_id']: (size, doc) for size, doc in stored}
        for m in markers:
            got = by_id.get(m['page_id'])
            r = got[1]['readings'][m['pos'] % max_readings] if got and len(
                got[1].get('readings', [])) > m['pos'] % max_readings else None
            if r is None or dt_ms(r.get('ts')) != m['ts_ms'] or r.get('f0') != m['f0']:
                problems.append('marker %d not at %s[%d]' % (m['no'], m['page_id'],
                                                              m['pos'] % max_readings))
        unseen = [m['no'] for m in markers if 'page_s' not in m or 'sum_s' not in m]
        if unseen:
            problems.append('markers %s not seen within %.0f s of the load\'s end' % (
                unseen, grace))

        # -- the model: a page's document is rewritten whole at each update; the size of a page
        # of n readings from its stored shape: header H (the document with readings: []) plus,
        # per reading i, 2 + digits(i) + c bytes (array element: type, key "i", the reading).
        csizes = set()
        heads = []
        exact = True
        for size, doc in stored:
            rs = doc.get('readings', [])
            cs = [len(bson.encode(r)) for r in rs]
            csizes.update(cs)
            h = len(bson.encode(dict(doc, readings=[])))
            heads.append(h)
            if h + sum(2 + len(str(i)) + c for i, c in enumerate(cs)) != size or \
                    len(bson.encode(doc)) != size:
                exact = False
        if not stored or len(csizes) != 1:
            raise BenchError('pages stored: %d; reading sizes %s (the model needs one)' % (
                len(stored), sorted(csizes)))
        c = csizes.pop()

        def page_size(h, n):
            return h + sum(2 + len(str(i)) + c for i in range(n))

        def page_cost(h, n_final, looked_up=False):
            """(updates, bytes written, readings written) of a page that ends with n_final
            readings, updated every per_update readings and once more with the rest; a page
            whose bucket the daemon had to look up first is written at once with the one
            reading drained by then, and counts on from there."""
            first = 1 if looked_up else 0
            ns = ([first] if first else []) + list(
                range(first + per_update, n_final, per_update)) + [n_final]
            if len(ns) > 1 and ns[-2] == ns[-1]:
                ns.pop()
            return len(ns), sum(page_size(h, n) for n in ns), sum(ns)

        # Buckets starting before the look-up horizon (start + buckets.max_future) may hold
        # pages of an earlier run: their page 0 is looked up, then written at the next flush.
        horizon = int(ready_s) + max_future_s
        m_updates = m_bytes = looked = 0
        for size, doc in stored:
            lu = doc.get('page') == 0 and dt_ms(doc.get('bucket_start')) // 1000 <= horizon
            looked += lu
            u, b, _ = page_cost(len(bson.encode(dict(doc, readings=[]))), doc.get('count', 0),
                                lu)
            m_updates += u
            m_bytes += b
        w_bytes = int(wstats['docBytesWritten'])
        w_updates = int(wstats['updatesApplied'])
        w_stored = int(wstats['storedBytes'])
        measured = w_bytes / w_stored if w_stored else None
        model_run = m_bytes / w_stored if w_stored else None
        # The model stands if it predicts this run's updates and bytes within 5%.
        agree = (measured is not None and abs(model_run - measured) <= 0.05 * measured and
                 abs(m_updates - w_updates) <= 0.05 * w_updates)
        # An hour of one 1 Hz sensor: 3,600 readings on pages of max_readings.
        h_med = sorted(heads)[len(heads) // 2]
        hour_pages = [max_readings] * (3600 // max_readings) + (
            [3600 % max_readings] if 3600 % max_readings else [])
        hour = [page_cost(h_med, p) for p in hour_pages]
        hour_written = sum(x[1] for x in hour)
        hour_stored = sum(page_size(h_med, p) for p in hour_pages)
        hour_ratio = hour_written / hour_stored
        hour_readings_ratio = sum(x[2] for x in hour) / 3600.0
        # Summaries: a bucket whose pages changed is recomputed at most once per
        # summaries.interval; a 1 Hz sensor's pages change every per_update s, so every round.
        s_bytes = int(sstats['docBytesWritten'])
        s_updates = int(sstats['updatesApplied'])
        s_count = int(sstats['count'])
        s_size = statistics.median(sdocs) if sdocs else None
        sum_run = s_bytes / w_stored if w_stored else None
        rounds_hour = 3600.0 / sum_interval
        sum_hour = rounds_hour * s_size / hour_stored if s_size else None

        # -- visibility and the write's own time on the wire
        bulks = [w for w in px.get('writes', []) if w.get('updates') and 't_server_reply' in w]
        wtimes = [w['t_server_reply'] - w['t_first'] for w in bulks]
        aggs = [a for a in px.get('aggregates', [])
                if a.get('merge') and 't_server_reply' in a]
        atimes = [a['t_server_reply'] - a['t_first'] for a in aggs]
        page_lat = [m['page_s'] for m in markers if 'page_s' in m]
        sum_lat = [m['sum_s'] for m in markers if 'sum_s' in m]
        w_max = max(wtimes) if wtimes else 0.0
        a_max = max(atimes) if atimes else 0.0
        page_bound = max_delay + interval + w_max
        sum_bound = max_delay + interval + w_max + sum_interval + a_max

        load = '%d sensors x 1 reading/s (2 fields) over UDP for %d s' % (sensors, dur)
        bad = '; PROBLEMS: %s' % '; '.join(problems) if problems else ''
        fig = ('11a. write cost: document bytes written by updates / bytes stored, pages of 1 Hz '
               'sensors over an hour (default config; measured over %d s, extrapolated by the '
               'model) [%s]' % (dur, load))
        cell = ('%.1fx for an hour (model; %.2fx in readings, as the unit test counts); '
                'measured over %d s: %.2fx (%d B written / %d B stored, %d updates), model for '
                'the same pages %.2fx (%d updates)%s; summaries: %.2fx of the pages\' stored '
                'bytes over %d s, %.2fx for an hour (model)%s' % (
                    hour_ratio, hour_readings_ratio, dur, measured, w_bytes, w_stored,
                    w_updates, model_run, m_updates,
                    ', agree' if agree else ', DISAGREE: the extrapolation does not stand',
                    sum_run, dur, sum_hour, bad))
        met = met_le(hour_ratio, 20.0) if agree and not problems else 'n/a (%s)' % (
            'model disagrees' if not agree else 'see PROBLEMS')
        self.rows.append(Row(fig, cell, '', '', '<= 20x', met))

        def lat(xs):
            return 'median %.1f s, max %.1f s (%d markers)' % (
                statistics.median(xs), max(xs), len(xs)) if xs else 'no marker seen'

        self.rows.append(Row(
            '11b. visibility: marked reading sent -> in its page (find by _id every %.1f s) '
            '[one of the %d sensors, a marker every %d s]' % (poll, sensors, mark_every),
            lat(page_lat) + bad, '', '',
            '<= max_delay + interval + write = %.0f s + %.2f s (slowest bulk on the wire)' % (
                max_delay + interval, w_max),
            (met_le(max(page_lat), page_bound + poll) if page_lat and not problems
             else 'n/a')))
        self.rows.append(Row(
            '11c. visibility: marked reading sent -> counted in its summary document (find '
            'every %.1f s)' % poll, lat(sum_lat) + bad, '', '',
            '<= that + summaries.interval + refresh = %.0f s + %.2f s (slowest bulk and '
            'slowest refresh aggregate on the wire)' % (
                max_delay + interval + sum_interval, w_max + a_max),
            (met_le(max(sum_lat), sum_bound + poll) if sum_lat and not problems
             else 'n/a')))

        self.note('11, write cost: sent %d readings (%d sensors, %d s, the sender at most %.2f s '
                  'behind its schedule), accepted %s, flushed %s in %s updates and %s bulk '
                  'writes, page_lookups %s, drops %s; summary_refreshes %s, '
                  'summary_buckets_refreshed %s, summary_refresh_errors %s; stand-in CPU %.0f%% '
                  'of a core, VmHWM %s; bucketd threads %s; bucketd stop %.1f s; %s' % (
                      n_sent, sensors, dur, sent['late_s'], st.get('readings_accepted'),
                      st.get('readings_flushed'), st.get('updates_sent'),
                      st.get('bulk_writes'), st.get('page_lookups'), drops or 'none',
                      st.get('summary_refreshes'), st.get('summary_buckets_refreshed'),
                      st.get('summary_refresh_errors'), 100 * db_cpu,
                      mib(standin_mem.get('VmHWM', 0)), daemon_cpu, d_stop,
                      describe_pool(hw)))
        self.note('11, the model: a page\'s document is rewritten whole at every update; with '
                  'flush.max_delay %gs and flush.interval %gs a 1 Hz page is updated once its '
                  'oldest pending reading waited max_delay, i.e. every %d readings, and once '
                  'more with the rest (page full, or the load\'s end), so a page of P readings '
                  'updated k times costs sum over j of size(min(j x %d, P)), about (k + 1) / 2 x '
                  'its size. size(n) = H + sum over i < n of (2 + digits(i) + c), from the '
                  'stored pages: c = %d B per reading (ts, f0 double, f1 int64), H = %d..%d B '
                  '(the page with readings: []); this reproduces %s. A freshly started daemon '
                  'first looks up the buckets that may hold pages of an earlier run (starting '
                  'before its start + buckets.max_future) and writes their page 0 at the next '
                  'flush with the one reading drained by then (%d pages here; a running '
                  'daemon creates the next hours\' buckets without a look-up, so the hour '
                  'below has none). Prediction for the %d stored pages of this run (%d..%d '
                  'readings): %d updates, %d B written = %.3fx; measured (bucketdTestStats): '
                  '%d updates, %d B = %.3fx (%+.1f%%). An '
                  'hour: pages of %s readings, %s updates, %d B written / %d B stored = %.2fx '
                  '(%.2fx counted in readings; the unit test flusher::an_hour_of_a_1hz_sensor_'
                  'rewrites_at_most_20_bytes_per_byte_stored counts 16.3 in readings over a '
                  'simulated hour of the real flusher)' % (
                      max_delay, interval, per_update, per_update, c, min(heads), max(heads),
                      'every stored page\'s size exactly' if exact else
                      'NOT every stored page\'s size', looked, len(stored),
                      min(doc.get('count', 0) for _, doc in stored),
                      max(doc.get('count', 0) for _, doc in stored), m_updates, m_bytes,
                      model_run, w_updates, w_bytes, measured,
                      100.0 * (model_run - measured) / measured if measured else 0.0,
                      '/'.join(str(p) for p in hour_pages),
                      '/'.join(str(x[0]) for x in hour), hour_written, hour_stored,
                      hour_ratio, hour_readings_ratio))
        self.note('11, summaries: %d summary documents of %s B (median), %d refreshes written '
                  '(%.1f per document over the %.0f s from the load\'s start to the stop), %d B '
                  'written = %.3fx the pages\' %d stored bytes; an hour: %g refreshes (one per '
                  'summaries.interval %gs: a 1 Hz sensor\'s pages change every %d s) x %s B / '
                  '%d B of pages = %.3fx' % (
                      s_count, s_size, s_updates, s_updates / s_count if s_count else 0,
                      wall, s_bytes, sum_run, w_stored, rounds_hour, sum_interval, per_update,
                      s_size, hour_stored, sum_hour))
        t_load = sent['t0'] or 0.0
        shapes = ['%.1f: %d/%d' % (px_t0 + w['t'] - t_load, w['updates'], w['readings'])
                  for w in px.get('writes', []) if w.get('updates')]
        self.note('11, bulk writes on the wire (s after the load\'s start: updates/readings): '
                  '%s' % (', '.join(shapes) or 'none'))
        self.note('11, visibility: page delays in s, in order: %s; summary delays: %s; bulk '
                  'writes on the wire (request -> server reply): %d, median %.3f s, max %.3f s; '
                  'summary refresh aggregates ($merge): %d, median %.3f s, max %.3f s' % (
                      ' '.join('%.1f' % x for x in page_lat) or 'none',
                      ' '.join('%.1f' % x for x in sum_lat) or 'none', len(wtimes),
                      statistics.median(wtimes) if wtimes else 0.0, w_max, len(atimes),
                      statistics.median(atimes) if atimes else 0.0, a_max))
        self.conditions.append(
            'write cost and visibility (rows 11): bucketd with its default config apart from '
            'listener, MongoDB URI and database, spool.dir, metrics off, writer_id and '
            'flush.stop_timeout 60s (flush.interval 1s, flush.max_delay 30s, '
            'buckets.max_readings 1000, summaries.interval 60s), writing through '
            'bench/count_proxy.py --replies (it times each bulk and refresh from request to '
            'the server\'s reply) into a fresh stand-in; the load comes from the suite itself '
            '(Python, one datagram per reading, %d sensors each once a second, timestamps '
            '"now"; %d sensors: what the Python stand-in takes with room to spare here, see '
            'its CPU share and the bulks\' times in the notes); --writecost %d s; byte counts '
            'from the stand-in\'s bucketdTestStats' % (sensors, sensors, dur))

    # -- 12. bytes read for a month of hourly summaries -----------------------------------------
    def fig_summaries(self):
        """One sensor at 1 Hz over many past hours, loaded over TCP; after the stop (which
        refreshes every summary due) the README's dashboard query on the summary collection,
        and the same range of the page collection, with the BSON sizes of every document each
        touches."""
        if importlib.util.find_spec('pymongo') is None:
            raise BenchError('pymongo is not importable by %s' % PYTHON)
        import bson
        from bson.codec_options import CodecOptions
        from bson.raw_bson import RawBSONDocument
        hours = int(self.summary_hours)
        sensor = 'dash,site=roof'
        fields = ('f0', 'f1')
        db_name = 'bench_summaries'
        span = 3600
        # Whole past hours, the newest ending where the current hour starts.
        h_end = int(time.time()) // span * span
        h0 = h_end - hours * span
        max_late_h = hours + 2
        rnd = random.Random(29)
        want = {}  # hour start -> {'count', field: [min, max, sum]}
        chunks = []
        buf = []
        for i in range(hours * span):
            ts = h0 + i
            v0 = float('%.2f' % rnd.uniform(-20.0, 40.0))
            v1 = rnd.randint(0, 1000)
            buf.append('%s f0=%.2f,f1=%di %d\n' % (sensor, v0, v1, ts * 10**9))
            w = want.setdefault(ts // span * span, {'count': 0, 'f0': [v0, v0, 0.0],
                                                    'f1': [v1, v1, 0]})
            w['count'] += 1
            for k, v in (('f0', v0), ('f1', v1)):
                w[k][0] = min(w[k][0], v)
                w[k][1] = max(w[k][1], v)
                w[k][2] += v
            if len(buf) == 4000:
                chunks.append(''.join(buf).encode())
                buf = []
        if buf:
            chunks.append(''.join(buf).encode())
        n_sent = hours * span
        line_bytes = sum(len(c) for c in chunks)
        standin = StandIn(self)  # fresh: only this sensor's documents
        d = None
        try:
            port = free_port('tcp')
            d = Bucketd(self, 'summaries', [('tcp', port, 'influx')], sink='mongodb',
                        uri=standin.uri, database=db_name,
                        extra=['buckets:', '  max_late: %dh' % max_late_h]).start()
            deadline = time.monotonic() + 20
            while 'indexes ready' not in d.log() and time.monotonic() < deadline:
                time.sleep(0.05)
            t0 = time.monotonic()
            with socket.create_connection(('127.0.0.1', port), timeout=600) as sock:
                for chunk in chunks:
                    sock.sendall(chunk)
            drained = wait_tcp_drained(port, timeout=600)
            t_sent = time.monotonic() - t0
            st = d.stop(timeout=1200)  # writes everything, then refreshes every summary due
            stop_s = d.stop_s
            d = None
            standin_mem = proc_status(standin.proc.pid)
            client = standin.client()
            db = client[db_name]
            raw = CodecOptions(document_class=RawBSONDocument)
            q = {'sensor_id': sensor,
                 'bucket_start': {'$gte': datetime.datetime.utcfromtimestamp(h0),
                                  '$lt': datetime.datetime.utcfromtimestamp(h_end)}}
            # The README's dashboard query, as a dashboard sends it (what comes back) ...
            proj = {'_id': 0, 'bucket_start': 1, 'count': 1, 'summary.f0': 1}
            t_q = time.monotonic()
            returned = [len(r.raw) for r in db['buckets_summary'].with_options(
                codec_options=raw).find(q, proj).sort('bucket_start', 1)]
            q_s = time.monotonic() - t_q
            # ... and every document it matches, whole: what the server reads for it.
            sdocs = [(len(r.raw), bson.decode(r.raw)) for r in db['buckets_summary'].with_options(
                codec_options=raw).find(q).sort('bucket_start', 1)]
            # The same range of the page collection: every page of those hours, whole.
            pdocs = [(len(r.raw), dt_ms(r['bucket_start']) // 1000, r['count'])
                     for r in db['buckets'].with_options(codec_options=raw).find(q).sort(
                         'bucket_start', 1)]
            psizes = {}
            for size, h, n in pdocs:
                psizes.setdefault(h, []).append((size, n))
            client.close()
        finally:
            if d is not None:
                d.stop()
            standin.stop()

        # -- checks: every reading stored, every hour's summary right
        problems = []
        drops = daemon_drops(st)
        if st.get('readings_accepted') != n_sent or st.get('readings_flushed') != n_sent or \
                drops or not drained:
            problems.append('sent %d, accepted %s, flushed %s, drops %s%s' % (
                n_sent, st.get('readings_accepted'), st.get('readings_flushed'),
                drops or 'none', '' if drained else ', TCP not drained'))
        if st.get('summary_refresh_errors') or st.get('summary_buckets_skipped'):
            problems.append('summary_refresh_errors %s, summary_buckets_skipped %s' % (
                st.get('summary_refresh_errors'), st.get('summary_buckets_skipped')))
        by_hour = {dt_ms(doc['bucket_start']) // 1000: (size, doc) for size, doc in sdocs}
        wrong = []
        for h, w in sorted(want.items()):
            got = by_hour.get(h)
            if got is None:
                wrong.append('%d: no summary' % h)
                continue
            doc = got[1]
            summ = doc.get('summary', {})
            ok = doc.get('count') == w['count'] and sorted(summ) == list(fields) and \
                sum(n for _, n in psizes.get(h, [])) == w['count'] and \
                doc.get('pages') == len(psizes.get(h, []))
            for k in fields:
                s = summ.get(k, {})
                ok = ok and s.get('count') == w['count'] and s.get('min') == w[k][0] and \
                    s.get('max') == w[k][1] and isinstance(s.get('sum'), float) and \
                    abs(s['sum'] - w[k][2]) <= 1e-9 * max(1.0, abs(w[k][2]))
            if not ok:
                wrong.append('%d: count %s of %d, pages %s' % (h, doc.get('count'), w['count'],
                                                               doc.get('pages')))
        if wrong:
            problems.append('%d of %d hours wrong (e.g. %s)' % (len(wrong), hours, wrong[0]))
        if len(sdocs) != hours:
            problems.append('the query matched %d summaries for %d hours' % (len(sdocs), hours))

        s_sizes = [size for size, _ in sdocs]
        p_hour = {h: sum(sz for sz, _ in v) for h, v in psizes.items()}
        p_pages = sorted(set(len(v) for v in psizes.values()))
        s_total = sum(s_sizes)
        p_total = sum(size for size, _, _ in pdocs)
        s_per_h = s_total / hours
        p_per_h = p_total / hours
        s_month = 720 * s_per_h
        p_month = 720 * p_per_h
        constant = (s_sizes and max(s_sizes) == min(s_sizes) and p_hour and
                    max(p_hour.values()) - min(p_hour.values()) <= 0.001 * p_per_h)
        one = sdocs[len(sdocs) // 2][1] if sdocs else {}
        per_field = {k: len(bson.encode({k: v})) - 5
                     for k, v in one.get('summary', {}).items()}
        bad = '; PROBLEMS: %s' % '; '.join(problems) if problems else ''
        fig = ('12. dashboard read: document bytes the server reads for a month of hourly '
               'summaries of one 1 Hz sensor (README query; 2 numeric fields; measured over '
               '%d hours, x 720 / %d)' % (hours, hours))
        cell = ('%s/month (%.0f B/hour: one summary document per hour, %s); the query returned '
                '%.0f B/hour with its projection%s%s' % (
                    '%.0f kB' % (s_month / 1e3), s_per_h,
                    'the same size every hour' if s_sizes and max(s_sizes) == min(s_sizes)
                    else 'sizes %d..%d B' % (min(s_sizes), max(s_sizes)),
                    sum(returned) / hours,
                    '' if constant else '; per-hour sizes vary: the x720 is approximate', bad))
        base = ('the pages of those hours: %.1f MB/month (%.0f B/hour in %s pages/hour)' % (
            p_month / 1e6, p_per_h, '/'.join(str(x) for x in p_pages)))
        ratio = '%s (%.0fx less)' % (pct(s_month / p_month), p_month / s_month) \
            if s_month and p_month else 'n/a'
        met = met_le(s_month, 1e6) if not problems else 'no (%s)' % '; '.join(problems)[:120]
        self.rows.append(Row(fig, cell, base, ratio, '<= 1 MB (10^6 B)', met))
        self.note('12, summaries: %d readings (%d hours x 3600, f0 float, f1 integer, timestamps '
                  '%s to %s) sent over one TCP connection and read by the daemon in %.2f s '
                  '(%s of lines), buckets.max_late %dh; accepted %s, flushed %s in %s '
                  'updates, page_lookups %s, summary_refreshes %s, summary_buckets_refreshed '
                  '%s; bucketd stop (writes the rest, then refreshes every summary due) '
                  '%.1f s; stand-in VmHWM %s' % (
                      n_sent, hours, datetime.datetime.utcfromtimestamp(h0).isoformat() + 'Z',
                      datetime.datetime.utcfromtimestamp(h_end - 1).isoformat() + 'Z', t_sent,
                      mib(line_bytes), max_late_h, st.get('readings_accepted'),
                      st.get('readings_flushed'), st.get('updates_sent'),
                      st.get('page_lookups'), st.get('summary_refreshes'),
                      st.get('summary_buckets_refreshed'), stop_s,
                      mib(standin_mem.get('VmHWM', 0))))
        self.note('12, sizes: summary documents %d..%d B (%s; the rest %d B), %d matched in '
                  '%.3f s, %d B returned with the projection {_id: 0, bucket_start: 1, count: 1, '
                  '"summary.f0": 1}; pages: %d..%d B per hour (%s pages), %d matched; per hour '
                  '%s; correctness: %s' % (
                      min(s_sizes) if s_sizes else 0, max(s_sizes) if s_sizes else 0,
                      ', '.join('summary.%s %d B' % kv for kv in sorted(per_field.items())),
                      (s_sizes[len(s_sizes) // 2] - sum(per_field.values())) if s_sizes else 0,
                      len(sdocs), q_s, sum(returned), min(p_hour.values()) if p_hour else 0,
                      max(p_hour.values()) if p_hour else 0,
                      '/'.join(str(x) for x in p_pages), len(pdocs),
                      'constant, so the month is 720 x the hourly figure' if constant else
                      'NOT constant', 'every hour\'s summary has count 3600 = readings sent, '
                      'pages = its page documents, and f0/f1 min, max, count and sum (to 1e-9) '
                      'equal to what was sent' if not wrong else '%d hours wrong: %s' % (
                          len(wrong), '; '.join(wrong[:3]))))
        self.conditions.append(
            'dashboard read (row 12): bucketd with its default config apart from listener, '
            'MongoDB URI and database, spool.dir, metrics off, writer_id, flush.stop_timeout '
            '60s and buckets.max_late %dh (for readings up to %d hours old), one sensor at '
            '1 Hz over %d past hours (--summary-hours) sent over TCP as fast as the daemon '
            'reads, into a fresh stand-in; after the stop, bytes = the BSON sizes of the whole '
            'documents the query matches (what the server reads), not only the projection it '
            'returns' % (max_late_h, hours, hours))

    # -- driver ---------------------------------------------------------------------------
    # -- 11. /metrics -----------------------------------------------------------------------
    def fig_metrics(self):
        self.have_sim()
        self.metrics_scrape()
        self.metrics_ingest()

    def metrics_scrape(self):
        """13a: scrape time with 100 k sensors tracked."""
        sensors = 2000 if self.quick else 100000
        n = 20 if self.quick else 200
        port, mport = free_port('tcp'), free_port('tcp')
        figure = '13a. /metrics scrape time, %s sensors tracked (median of %d scrapes)' % (
            si(sensors), n)
        per = 12
        d = Bucketd(self, 'metrics-scrape', [('tcp', port, 'influx')], metrics_port=mport).start()
        try:
            # The simulator picks a sensor at random for every reading: 12 per sensor leave
            # about e^-12 of them (one in 160,000) without one.
            per = 12
            run_sim(self, Load(sensors, self.fields).args(port, proto='tcp',
                                                           count=sensors * per),
                    max(120, sensors / 1000.0))
            wait_tcp_drained(port, timeout=max(30.0, sensors / 5000.0))
            deadline = time.monotonic() + 30
            last = None
            while True:  # the socket is read; the last lines may still be on their way
                _, status, body = http_get_timed(mport, '/metrics')
                tracked = metric_value(body.decode(), 'bucketd_sensors')
                if status != 200 or tracked == last or time.monotonic() > deadline:
                    break
                last = tracked
                time.sleep(0.5)
            if status != 200 or tracked is None or tracked < 0.999 * sensors:
                raise BenchError('/metrics answered %s with bucketd_sensors %s (want %d)' % (
                    status, tracked, sensors))
            size = len(body)
            scrape, base = [], []
            for _ in range(n):  # alternate, so that drift affects both alike
                scrape.append(http_get_timed(mport, '/metrics')[0])
                base.append(http_get_timed(mport, '/nope')[0])
        finally:
            d.stop()
        med, p99 = statistics.median(scrape), sorted(scrape)[int(0.99 * (n - 1))]
        bmed = statistics.median(base)
        self.rows.append(Row(figure, '%.2f ms (p99 %.2f ms; %d bytes)' % (
            med * 1e3, p99 * 1e3, size), '404 on the same server %.2f ms' % (bmed * 1e3),
            '%.1fx' % (med / bmed), '<= 5 ms', met_le(med, 0.005)))
        self.note('13a: %d readings of %s sensors sent over TCP first (bucketd_sensors %d); each '
                  'scrape is a new connection, GET, read to the close, timed by the client '
                  '(Python, same machine): /metrics median %.3f ms, p99 %.3f ms, max %.3f ms; a '
                  '404 (no rendering: the connection and HTTP cost alone) median %.3f ms' % (
                      sensors * per, si(sensors), tracked, med * 1e3, p99 * 1e3,
                      max(scrape) * 1e3, bmed * 1e3))

    def metrics_ingest_run(self, scrape_every):
        """One flat-out TCP run (as row 3) with a scrape every scrape_every s (0: none);
        returns (accepted readings/s, scrapes)."""
        import threading
        conns = 3
        dur = 1.0 if self.quick else 5.0
        port, mport = free_port('tcp'), free_port('tcp')
        # A name (and directory) of its own per run: start() looks for "ready" in the log
        # file, which a previous daemon of the same name would still hold.
        self.metrics_runs = getattr(self, 'metrics_runs', 0) + 1
        d = Bucketd(self, 'metrics-ingest-%d' % self.metrics_runs, [('tcp', port, 'influx')],
                    metrics_port=mport).start()
        scrapes = []
        stop = threading.Event()

        def scraper():
            while not stop.wait(scrape_every):
                dt, status, _ = http_get_timed(mport, '/metrics')
                scrapes.append((dt, status))
        t = threading.Thread(target=scraper, daemon=True) if scrape_every else None
        try:
            load = Load(self.udp_sensors, self.fields, extra=['--connections', str(conns)])
            t0 = time.monotonic()
            if t is not None:
                t.start()
            res = run_sim(self, load.args(port, proto='tcp', duration=dur), dur + 60)
            drained = wait_tcp_drained(port)
            t1 = time.monotonic()
        finally:
            stop.set()
            if t is not None:
                t.join(10)
            st = d.stop()
        accepted = st.get('readings_accepted', 0)
        if accepted != res['readings'] or daemon_drops(st) or not drained:
            raise BenchError('accepted %d of %d, drops %s' % (accepted, res['readings'],
                                                               daemon_drops(st)))
        if any(status != 200 for _, status in scrapes):
            raise BenchError('a scrape failed: %s' % scrapes)
        return accepted / (t1 - t0), scrapes

    def metrics_ingest(self):
        """13b: ingest rate with one scrape a second against none, runs alternated."""
        rounds = 2 if self.quick else 4
        figure = ('13b. TCP -> blackhole flat out, one /metrics scrape a second vs none '
                  '(lines/s, median of %d runs each)' % rounds)
        none, every = [], []
        scrapes = []
        for _ in range(rounds):
            none.append(self.metrics_ingest_run(0)[0])
            r, sc = self.metrics_ingest_run(1.0)
            every.append(r)
            scrapes += sc
        base, with_ = statistics.median(none), statistics.median(every)
        spread = (max(none) - min(none)) / base
        diff = (base - with_) / base
        met = 'yes (%+.1f%%, within the no-scrape runs\' spread of %.1f%%)' % (
            -diff * 100, spread * 100) if diff <= spread else 'no (%+.1f%%, spread %.1f%%)' % (
            -diff * 100, spread * 100)
        self.rows.append(Row(figure, si(with_), si(base), '%.3f' % (with_ / base),
                             'no difference beyond noise', met))
        self.note('13b: 3 TCP connections, %d sensors, flat out; runs alternated, each on a '
                  'fresh daemon: without scrapes %s, with a scrape a second %s lines/s; %d '
                  'scrapes, median %.2f ms' % (
                      self.udp_sensors, ', '.join(si(x) for x in none),
                      ', '.join(si(x) for x in every), len(scrapes),
                      statistics.median([dt for dt, _ in scrapes]) * 1e3 if scrapes else 0))

    # -- 14. TLS ----------------------------------------------------------------------------
    def tls_files(self):
        d = os.path.join(self.work, 'tls-certs')
        cert, key = os.path.join(d, 'server.pem'), os.path.join(d, 'server.key')
        if not os.path.exists(cert):
            os.makedirs(d, exist_ok=True)
            subprocess.run(['openssl', 'req', '-x509', '-newkey', 'ec', '-pkeyopt',
                            'ec_paramgen_curve:P-256', '-nodes', '-keyout', key, '-out', cert,
                            '-days', '2', '-subj', '/CN=localhost',
                            '-addext', 'subjectAltName=IP:127.0.0.1'],
                           check=True, capture_output=True, timeout=60)
        return cert, key

    def tls_run(self, tls, data, lines_per_buf, conns, dur):
        """One fresh daemon, conns senders flat out for dur s: (lines/s, protocol, cipher)."""
        import ssl
        import threading
        self.tls_runs = getattr(self, 'tls_runs', 0) + 1
        port = free_port('tcp')
        files = self.tls_files() if tls else None
        d = Bucketd(self, 'tls-%d' % self.tls_runs, [('tcp', port, 'influx')], tls=files).start()
        sent = [0] * conns
        errors = []
        session = {}
        ctx = None
        if tls:
            ctx = ssl.create_default_context(cafile=files[0])

        def sender(i):
            try:
                s = socket.create_connection(('127.0.0.1', port), timeout=60)
                if ctx is not None:
                    s = ctx.wrap_socket(s, server_hostname='localhost')
                    session['version'], session['cipher'] = s.version(), s.cipher()[0]
                end = time.monotonic() + dur
                n = 0
                while time.monotonic() < end:
                    s.sendall(data)
                    n += 1
                sent[i] = n * lines_per_buf
                if ctx is not None:
                    s = s.unwrap()
                s.close()
            except (OSError, ssl.SSLError) as e:
                errors.append(repr(e))

        try:
            threads = [threading.Thread(target=sender, args=(i,)) for i in range(conns)]
            t0 = time.monotonic()
            for t in threads:
                t.start()
            for t in threads:
                t.join(dur + 120)
            drained = wait_tcp_drained(port)
            t1 = time.monotonic()
        finally:
            st = d.stop()
        accepted = st.get('readings_accepted', 0)
        if errors or accepted != sum(sent) or daemon_drops(st) or not drained:
            raise BenchError('%s: accepted %d of %d, drops %s, sender errors %s' % (
                'TLS' if tls else 'plain', accepted, sum(sent), daemon_drops(st), errors))
        if tls and st.get('tls_handshakes', 0) != conns:
            raise BenchError('TLS: %s handshakes for %d connections' % (
                st.get('tls_handshakes'), conns))
        return accepted / (t1 - t0), session.get('version'), session.get('cipher')

    def fig_tls(self):
        """14: TLS ingest rate against plain TCP, same sender, runs alternated."""
        conns, rounds = 3, (1 if self.quick else 4)
        dur = 1.5 if self.quick else 5.0
        # Row 3's kind of lines (1000 sensors, 3 fields, 47 bytes, arrival time), from a
        # sender both runs share: Python's sendall of one prepared buffer of a few MiB, so the sender
        # costs the same on both sides apart from the encryption TLS adds to it.
        lines = [b'bench,sensor=s%04d f0=%d.%02d,f1=%d.%02d,f2=%di\n' % (
            i % 1000, i % 97, i % 100, i % 89, i % 61, i) for i in range(60000)]
        data = b''.join(lines)
        plain, tls = [], []
        version = cipher = None
        for _ in range(rounds):
            plain.append(self.tls_run(False, data, len(lines), conns, dur)[0])
            r, version, cipher = self.tls_run(True, data, len(lines), conns, dur)
            tls.append(r)
        base, got = statistics.median(plain), statistics.median(tls)
        self.rows.append(Row(
            '14. TLS vs plain TCP -> blackhole, flat out, %d connections (lines/s, median of %d '
            'runs each) [1000 sensors, 3 fields, influx, %s %s]' % (
                conns, rounds, version, cipher), si(got), si(base), '%.3f' % (got / base), '', ''))
        self.note('14: %d connections for %g s each run, %d lines of %.0f bytes per %s buffer '
                  'sent whole (Python sendall; ssl for TLS, P-256 certificate); runs '
                  'alternated, each on a fresh daemon; plain %s, TLS %s lines/s' % (
                      conns, dur, len(lines), len(data) / len(lines), mib(len(data)),
                      ', '.join(si(x) for x in plain), ', '.join(si(x) for x in tls)))

    # -- 16. hostile senders -----------------------------------------------------------------
    # 16a's hostile sensor: the rate of the one measured when the fairness problem was found
    # (about 13 k lines/s of 32 fields); 0 sends flat out.
    def fig_hostile(self):
        self.have_sim()
        self.hostile_fairness()
        self.hostile_flood()

    def hostile_fairness(self):
        import fairness  # bench/fairness.py: row 16a's runs and probes
        runs = 1 if self.quick else 2
        figure = ('16a. %s legitimate TCP lines beside one hostile 32-field sensor (%s lines/s), '
                  'as a ratio of the same lines alone (into the stand-in, default limits; median '
                  'of %d rounds each, runs alternated)' % (
                      si(LEGIT_LINES), si(HOSTILE_RATE) if HOSTILE_RATE else 'flat out',
                      runs * self.legit_rounds))
        try:
            r0, r1, st0, st1, probes = fairness.alternated(self, sys.modules[__name__],
                                                           HOSTILE_RATE, runs)
        except BenchError as e:
            self.rows.append(not_run(figure, e, '>= 0.5'))
            return
        alone, beside = statistics.median(r0), statistics.median(r1)
        ratio = beside / alone
        self.rows.append(Row(figure, '%s lines/s' % si(beside), '%s lines/s alone' % si(alone),
                             '%.2f' % ratio, '>= 0.5', met_ge(ratio, 0.5)))
        total = lambda sts, k: sum(st.get(k, 0) for st in sts)
        self.note('16a: each round is bucketd-sim --proto tcp, 10 sensors, 3 fields, %d lines '
                  'flat out on a new connection, timed from its start until the daemon has read '
                  'its socket to the end (rounds alone: %s; beside: %s lines/s; %d runs of each, '
                  'alone and beside alternated, a fresh daemon each); the hostile sensor is '
                  'bucketd-sim, 1 sensor, 32 fields, %s on its own connection (another listener, '
                  'sensor number %d: a series of its own) from %g s before the first round. The '
                  'daemon paused the hostile connection %d times (tcp_sensor_pauses) and '
                  'accepted %d of its readings' % (
                      LEGIT_LINES, ', '.join(si(x) for x in r0), ', '.join(si(x) for x in r1),
                      runs, '%d lines/s' % HOSTILE_RATE if HOSTILE_RATE else 'flat out',
                      fairness.HOSTILE_SENSOR, self.hostile_lead_s,
                      total(st1, 'tcp_sensor_pauses'),
                      total(st1, 'readings_accepted') - total(st0, 'readings_accepted')))
        self.note(fairness.describe_note(probes))

    def hostile_flood(self):
        names = 20000 if self.quick else 1000000
        figure = ('16b. flood of %s new sensor names over UDP, default limits (peak RSS, VmHWM, '
                  'against limits.memory + limits.sensor_memory + idle)' % si(names))
        port = free_port('udp')
        d = Bucketd(self, 'flood', [('udp', port, 'influx')]).start()
        try:
            idle = proc_status(d.pid)
            res = run_sim(self, Load(names, 1, per_datagram=50, max_datagram=65000).args(
                port, proto='udp', count=names), 600)
            wait_rx_drained(port)
            time.sleep(1.5)
            peak = proc_status(d.pid)
        except BenchError as e:
            d.stop()
            self.rows.append(not_run(figure, e))
            return
        st = d.stop(timeout=300)
        budget = 64 * MIB + 64 * MIB + idle['VmHWM']
        hwm = peak['VmHWM']
        self.rows.append(Row(figure, mib(hwm), 'budget %s' % mib(budget),
                             '%.2f' % (hwm / budget), '<= budget', met_le(hwm, budget)))
        self.note('16b: bucketd-sim sent %d readings of %d distinct sensors (50 a datagram, '
                  'blackhole sink): accepted %d, drop_sensor_limit %d, drop_sensor_memory %d, '
                  'drop_sensor_busy %d, kernel drops %d; idle VmHWM %s' % (
                      res['readings'], names, st.get('readings_accepted', 0),
                      st.get('drop_sensor_limit', 0), st.get('drop_sensor_memory', 0),
                      st.get('drop_sensor_busy', 0), st.get('udp_socket_drops', 0),
                      mib(idle['VmHWM'])))

    def run(self):
        figs = [('parser', self.fig_parser), ('udp', self.fig_udp), ('tcp', self.fig_tcp),
                ('memory', self.fig_memory), ('latency', self.fig_latency),
                ('standin', self.fig_into_standin), ('peers', self.fig_peers),
                ('slowdb', self.fig_slowdb), ('replay', self.fig_replay),
                ('writecost', self.fig_writecost), ('summaries', self.fig_summaries),
                ('metrics', self.fig_metrics), ('tls', self.fig_tls),
                ('idleconns', self.fig_idleconns), ('hostile', self.fig_hostile),
                ('reboot', self.fig_reboot), ('loops', self.fig_loops)]
        names = {'parser': '1. parser', 'udp': '2. UDP end to end', 'tcp': '3. TCP end to end',
                 'memory': '4. memory', 'latency': '5. flush latency',
                 'standin': '6. into the stand-in', 'peers': '7. peers',
                 'slowdb': '8. UDP into a MongoDB taking 1 s per bulk',
                 'replay': '9. replay after an outage',
                 'writecost': '11. write cost and visibility (1 Hz sensors)',
                 'summaries': '12. dashboard read cost (summaries)',
                 'metrics': '13. /metrics', 'tls': '14. TLS vs plain TCP',
                 'idleconns': '15. idle TCP connections (memory)',
                 'hostile': '16. hostile senders',
                 'reboot': '17. reboot during an outage',
                 'loops': '2c. ingest.loops 1 vs 2'}
        disk_done = False
        for key, fn in figs:
            if key == 'writecost' and not disk_done:
                # Row 10 comes from rows 2-8, all done by now: it goes before rows 11 and 12.
                self.disk_rows()
                disk_done = True
            if not self.want(key):
                continue
            if key == 'peers' and self.quick:
                self.rows.append(Row('7. peers', 'not run: --quick', '', '', '', 'n/a'))
                continue
            if key == 'reboot' and self.quick and (self.only is None or 'reboot' not in self.only):
                self.rows.append(Row('17. reboot during an outage',
                                     'not run: --quick (--only reboot runs it)', '', '', '',
                                     'n/a'))
                continue
            if key == 'writecost' and self.skip_writecost:
                self.rows.append(Row('11. write cost and visibility (1 Hz sensors)',
                                     'not run: --quick (--only writecost or --writecost S runs '
                                     'it)', '', '', '', 'n/a'))
                continue
            t0 = time.monotonic()
            log('--- %s' % names[key])
            try:
                fn()
            except (BenchError, OSError, ImportError, subprocess.SubprocessError) as e:
                log('%s failed: %s' % (names[key], e))
                self.rows.append(not_run(names[key], e))
            log('--- %s: %.1f s' % (names[key], time.monotonic() - t0))
        if self.standin is not None:
            self.standin.stop()
            self.standin = None
        if not disk_done:
            self.disk_rows()

    # -- 10. bytes written under spool.dir on the healthy path ---------------------------------
    def disk_rows(self):
        for group, ws in self.disk.items():
            spool = sum(w['spool_bytes'] for w in ws)
            allb = sum(w['all_bytes'] for w in ws)
            wb = [w['write_bytes'] for w in ws if w['write_bytes'] is not None]
            spooled = sum(w['spooled'] or 0 for w in ws)
            changed = sorted(set(c.split(' ')[0] for w in ws for c in w['changed']))
            cell = ('spool files (spool-*.seg, spool.ckpt) %+d B; all files %+d B%s; '
                    'write_bytes %s (/proc/PID/io, %d of %d daemons readable); '
                    'readings_spooled %d' % (
                        spool, allb, ' (changed: %s)' % ', '.join(changed) if changed else '',
                        '%d B' % sum(wb) if wb else 'n/a', len(wb), len(ws), spooled))
            if spool == 0 and spooled == 0:
                met = 'yes (spool files)'
                if allb or (wb and sum(wb)):
                    met += '; not 0 for all files / write_bytes: see notes'
            else:
                met = 'no'
            self.rows.append(Row('10. bytes written under spool.dir, healthy path: %s (%d '
                                 'daemons, each on a fresh spool.dir)' % (group, len(ws)),
                                 cell, '', '', '0 B', met))
            per = {}
            for w in ws:
                for c in w['changed']:
                    per.setdefault(c.split(' ')[0], []).append(c.split(' ', 1)[1])
            self.note('10, %s: per daemon, write_bytes %s; files changed between ready and '
                      'exit: %s' % (
                          group, ' '.join(str(w['write_bytes']) for w in ws),
                          '; '.join('%s (%d daemons, e.g. %s)' % (n, len(v), v[0])
                                    for n, v in sorted(per.items())) or 'none'))
        if self.disk:
            self.conditions.append(
                'spool.dir writes (row 10): every daemon gets a fresh spool.dir; the sizes of '
                'the files there are summed once the daemon is ready (the spool\'s empty '
                '32-byte first segment is already there) and after it exited; write_bytes is '
                'the daemon\'s /proc/PID/io from ready to its exit (read before it is reaped), '
                'which counts every file it writes (its log goes to a pipe)')


def flat_label(trials):
    """What the flat-out steps of a search say about the limit."""
    flat = [t for t in trials if not t['rate']]
    if all(t['lossless'] for t in flat):
        return ' (sender-bound: lossless at every flat-out step)'
    if flat[0]['lossless']:
        return ' (lossless flat out, lost at a faster flat-out step)'
    return ''


def dt_ms(dt):
    """Milliseconds since the epoch of a BSON date as pymongo gives it (naive UTC)."""
    if not isinstance(dt, datetime.datetime):
        return None
    if dt.tzinfo is not None:
        dt = dt.astimezone(datetime.timezone.utc).replace(tzinfo=None)
    return calendar.timegm(dt.timetuple()) * 1000 + dt.microsecond // 1000


def parse_recorded(path):
    """{seq: (series key, timestamp ms, {field: value})} of the line-protocol lines a
    bucketd-sim --record file holds (simple lines: no escapes, no strings)."""
    out = {}
    with open(path, 'rb') as f:
        for raw in f:
            parts = raw.decode('utf-8', 'replace').split()
            if len(parts) != 3:
                continue
            head, fields, ts = parts
            name, _, tags = head.partition(',')
            key = ','.join([name] + sorted(tags.split(','))) if tags else name
            values = {}
            for kv in fields.split(','):
                k, _, v = kv.partition('=')
                values[k] = int(v[:-1]) if v.endswith('i') else float(v)
            seq = values.get('seq')
            if isinstance(seq, int):
                out[seq] = (key, int(ts) // 1000000, values)
    return out


def same_values(got, want):
    """Equal field sets and values, integers stored as integers and floats as floats (pymongo
    gives int64 as bson.int64.Int64, a subclass of int)."""
    if set(got) != set(want):
        return False
    for k, v in want.items():
        g = got[k]
        if isinstance(v, int):
            if not isinstance(g, int) or isinstance(g, bool) or g != v:
                return False
        elif not isinstance(g, float) or g != v:
            return False
    return True


def steady_state(writes, max_updates=1000):
    """Group the bulk writes seen on the wire into flushes and sum the flushes between the
    first and the last, which the start and the stop of the load cut short. A flush is one bulk
    write, or several when it had more than flush.max_updates updates: a write carrying exactly
    max_updates is continued by the next one."""
    writes = [w for w in writes if w.get('updates')]
    if not writes:
        return None
    flushes = []
    cont = False
    for w in writes:
        if not cont:
            flushes.append({'updates': 0, 'readings': 0, 'bytes': 0})
        f = flushes[-1]
        f['updates'] += w['updates']
        f['readings'] += w['readings']
        f['bytes'] += w['bytes']
        cont = w['updates'] == max_updates
    mid = flushes[1:-1]
    if not mid:
        return {'flushes': len(flushes), 'rpu': None}
    u = sum(f['updates'] for f in mid)
    r = sum(f['readings'] for f in mid)
    return {'flushes': len(flushes), 'rpu': r / u if u else None,
            'bytes_per_reading': sum(f['bytes'] for f in mid) / r if r else None}


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------

def sh(cmd, cwd=None):
    try:
        return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ''


def machine_header(suite, args):
    cpu = 'unknown'
    with open('/proc/cpuinfo') as f:
        for line in f:
            if line.startswith('model name'):
                cpu = line.split(':', 1)[1].strip()
                break
    with open('/proc/sys/net/core/rmem_max') as f:
        rmem = int(f.read())
    load = os.getloadavg()
    commit = args.commit or sh(['git', 'rev-parse', '--short', 'HEAD'], cwd=suite.repo) or '?'
    dirty = args.dirty
    cc = sh(['cc', '--version']).splitlines()
    lines = [
        '# bucketd benchmarks%s' % (' (--quick)' if suite.quick else ''),
        '',
        '- machine: %s, %d cores, kernel %s, net.core.rmem_max %d (%s)' % (
            cpu, os.cpu_count(), platform.release(), rmem, mib(rmem)),
        '- date: %s; commit %s%s (taken when the build started)' % (
            args.date, commit, ' plus uncommitted changes to tracked files' if dirty else ''),
        '- build: Release (%s), %s' % (os.path.relpath(suite.build, suite.repo),
                                       cc[0] if cc else 'cc'),
        '- conditions: shared machine, load average at start %.2f %.2f %.2f; %s; all traffic '
        'on loopback; ratios compare against baselines measured in this run' % (
            load[0], load[1], load[2],
            'private network namespace (kernel UDP counters are ours alone)'
            if args.netns else 'host network namespace (kernel UDP counters are shared)'),
    ]
    for c in suite.conditions:
        lines.append('- %s' % c)
    return lines


def render(suite, args):
    out = machine_header(suite, args)
    out += ['', '| figure | bucketd | baseline | ratio | target | met? |',
            '| --- | --- | --- | --- | --- | --- |']
    for r in suite.rows:
        out.append('| ' + ' | '.join(c.replace('|', '/') for c in r.cells) + ' |')
    if suite.notes:
        out += ['', 'Notes (measurements behind the rows):', '']
        out += ['- %s' % n for n in suite.notes]
    out += ['', 'Suite time: %.0f s.' % (time.monotonic() - suite.t_start)]
    return '\n'.join(out) + '\n'


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--repo', required=True)
    ap.add_argument('--build', required=True)
    ap.add_argument('--work', required=True)
    ap.add_argument('--quick', action='store_true')
    ap.add_argument('--out', default='')
    ap.add_argument('--only', default='', help='comma list: parser,udp,tcp,memory,latency,'
                    'standin,peers,slowdb,replay,writecost,summaries,metrics,tls,idleconns,'
                    'hostile,reboot,loops')
    ap.add_argument('--date', default=datetime.datetime.now().strftime('%Y-%m-%d %H:%M %Z'))
    ap.add_argument('--netns', action='store_true', help='running in a private netns')
    ap.add_argument('--commit', default='', help='short commit of the measured code')
    ap.add_argument('--dirty', action='store_true', help='tracked files had changes')
    ap.add_argument('--outage', type=float, default=0.0,
                    help='seconds MongoDB is away before the replay row (default 600; --quick: '
                    'until the spool holds records for 1 s, at most 60)')
    ap.add_argument('--writecost', type=float, default=0.0,
                    help='seconds of 1 Hz load for the write-cost row (default 300, --quick 60)')
    ap.add_argument('--summary-hours', type=int, default=0,
                    help='past hours of 1 Hz readings for the summaries row (default 48, '
                    '--quick 6)')
    args = ap.parse_args()

    def on_term(signum, frame):
        raise KeyboardInterrupt('signal %d' % signum)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)
    suite = Suite(args)
    try:
        suite.run()
    except KeyboardInterrupt:
        log('interrupted; stopping every process started')
        suite.procs.stop_all()
        return 130
    finally:
        suite.procs.stop_all()
    text = render(suite, args)
    sys.stdout.write(text)
    if args.out:
        with open(args.out, 'w') as f:
            f.write(text)
    return 0


if __name__ == '__main__':
    sys.exit(main())
