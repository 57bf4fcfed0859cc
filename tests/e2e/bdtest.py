"""Shared harness for bucketd's end-to-end tests.

Runs the real daemon binary against the MongoDB test server (tests/mongo_server.py through
tests/e2e/mongo_fixture.py) or, when BUCKETD_TEST_MONGODB_URI is set, against that MongoDB.

Environment:
  BUCKETD_BIN               daemon binary (default <repo>/build/bucketd)
  BUCKETD_SOURCE_DIR        repository root (default: two levels above this file)
  BUCKETD_TEST_MONGODB_URI  use this MongoDB instead of the test server
  BUCKETD_CLOCK_SHIM        tests/e2e/clock_shim.c built (default <repo>/build/tests/clock_shim.so)
  BUCKETD_E2E_KEEP=1        keep each test's temporary directory (config, log, spool)

Pieces:
  free_port(), to_yaml()       ports and config text
  Daemon                       writes a config, runs bucketd, waits for "ready", stops it with
                               SIGTERM, parses the "stats:" line
  check_documents()            every invariant of a bucket document (DESIGN.md §3)
  check_readings()             every sent reading stored exactly once with the right values
  E2ECase                      unittest base: one test server per class, one database per test
"""

import calendar
import datetime
import http.client
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.parse

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.environ.get("BUCKETD_SOURCE_DIR") or os.path.dirname(os.path.dirname(HERE))
BIN = os.environ.get("BUCKETD_BIN") or os.path.join(REPO, "build", "bucketd")
INSPECT = (os.environ.get("BUCKETD_INSPECT_BIN") or
           os.path.join(REPO, "build", "bucketd-inspect"))
CLOCK_SHIM = (os.environ.get("BUCKETD_CLOCK_SHIM") or
              os.path.join(REPO, "build", "tests", "clock_shim.so"))

for _p in (HERE, os.path.dirname(HERE), os.path.join(REPO, "tools")):  # tests/: fault_proxy
    if _p not in sys.path:
        sys.path.insert(0, _p)

import bson  # noqa: E402  (python3-bson, with pymongo)
import send_readings  # noqa: E402  (tools/send_readings.py)

# libmongoc's shared-memory counters (/dev/shm/mongoc-<pid>, created when the library loads) are
# left behind by every daemon a test kills; a process that later gets the same pid warns about it
# on stderr. Nothing reads them: off for every process the tests start (tools/test.sh does the
# same for the whole run).
os.environ.setdefault("MONGOC_DISABLE_SHM", "1")

NS_PER_MS = 1_000_000
NS_PER_S = 1_000_000_000

READY_RE = re.compile(r"\bready\b")
LOG_PREFIX_RE = re.compile(r"^<(\d)>")


# ---------------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------------

_ports_given = set()
_port_locks = []  # lock files of the ports handed out, held until this process exits


def _fixed_port_range():
    """Loopback ports to hand out: below the kernel's ephemeral range, which bind(port 0) and
    every connect() draw from (a port taken from there and released again can become another
    process's client port before the daemon binds it), or None when that range starts too low
    to leave room."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    if low - 1 < 12000:
        return None
    return 10000, low - 1


def _lock_port(kind, port):
    """Claim (kind, port) among all test processes of this machine (ctest runs several at
    once): an exclusive lock on a file named after it, held until this process exits."""
    import fcntl
    lock_dir = os.path.join(tempfile.gettempdir(), "bucketd-e2e-ports")
    os.makedirs(lock_dir, exist_ok=True)
    fd = os.open(os.path.join(lock_dir, "%s-%d" % (kind, port)), os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False
    _port_locks.append(fd)
    return True


def free_port(kind="tcp"):
    """A loopback port free right now for kind "tcp" or "udp", not handed out before by this
    process (two listeners of one configuration on one port make the daemon refuse its start)
    nor by another test process still running (ctest -j: a lock file per port). Taken below the
    ephemeral range where there is one (_fixed_port_range), else from bind(port 0)."""
    import random
    stype = socket.SOCK_STREAM if kind == "tcp" else socket.SOCK_DGRAM
    span = _fixed_port_range()
    for _ in range(200):
        with socket.socket(socket.AF_INET, stype) as s:
            try:
                s.bind(("127.0.0.1", random.randint(*span) if span else 0))
            except OSError:
                continue  # in use here (or in TIME_WAIT): another one
            port = s.getsockname()[1]
            if (kind, port) in _ports_given or not _lock_port(kind, port):
                continue
        _ports_given.add((kind, port))
        return port
    raise RuntimeError("no fresh %s port in 200 tries" % kind)


def closed_port():
    """A loopback TCP port nobody listens on (for an unreachable MongoDB)."""
    return free_port("tcp")


def wait_for(cond, timeout, interval=0.05):
    """Poll cond() until it returns something truthy or timeout seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() >= deadline:
            return v
        time.sleep(interval)


_PLAIN_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_./-]*$")
_YAML_WORDS = {"true", "false", "yes", "no", "on", "off", "null", "y", "n", "~"}


def clock_shim_env(control=None):
    """Environment for a daemon under the clock shim (tests/e2e/clock_shim.c): the wall clock
    offset and the kernel's synchronisation status the file `control` holds ("<offset_ns>
    <synced>"); without one, the real wall clock, reported synchronised whatever the test
    machine's kernel says."""
    if not os.path.exists(CLOCK_SHIM):
        raise AssertionError("the clock shim is not built: %s (set BUCKETD_CLOCK_SHIM)"
                             % CLOCK_SHIM)
    env = {"LD_PRELOAD": CLOCK_SHIM}
    if control is not None:
        env["BD_CLOCK_SHIM_FILE"] = control
    # ASan wants its runtime first in the library list; the shim comes before it here.
    asan = os.environ.get("ASAN_OPTIONS", "")
    env["ASAN_OPTIONS"] = (asan + ":" if asan else "") + "verify_asan_link_order=0"
    return env


def yaml_scalar(v):
    if v is True:
        return "true"
    if v is False:
        return "false"
    if isinstance(v, (int, float)):
        return repr(v)
    s = str(v)
    if _PLAIN_RE.match(s) and s.lower() not in _YAML_WORDS:
        return s
    # A JSON string is a valid YAML double-quoted scalar for the characters used here.
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def to_yaml(obj, indent=0):
    """Block-style YAML for dicts, lists of dicts/scalars and scalars (config files only)."""
    pad = " " * indent
    out = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            if isinstance(v, (dict, list)) and v:
                out.append("%s%s:" % (pad, k))
                out.append(to_yaml(v, indent + 2))
            elif isinstance(v, dict):
                out.append("%s%s: {}" % (pad, k))
            elif isinstance(v, list):
                out.append("%s%s: []" % (pad, k))
            else:
                out.append("%s%s: %s" % (pad, k, yaml_scalar(v)))
    elif isinstance(obj, list):
        for item in obj:
            if isinstance(item, dict) and item:
                body = to_yaml(item, indent + 2).split("\n")
                out.append("%s- %s" % (pad, body[0][indent + 2:]))
                out.extend(body[1:])
            else:
                out.append("%s- %s" % (pad, yaml_scalar(item)))
    else:
        out.append(pad + yaml_scalar(obj))
    return "\n".join(out)


def deep_merge(base, extra):
    """Return base updated recursively with extra (dicts merged, everything else replaced)."""
    out = dict(base)
    for k, v in (extra or {}).items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def dt_ms(dt):
    """Milliseconds since the epoch of a BSON date as pymongo returns it (naive UTC)."""
    if dt.tzinfo is not None:
        dt = dt.astimezone(datetime.timezone.utc).replace(tzinfo=None)
    return calendar.timegm(dt.timetuple()) * 1000 + dt.microsecond // 1000


def parse_stats(text):
    """The counters of the last "stats: name=value ..." log line, as a dict of ints."""
    stats = None
    for line in text.splitlines():
        idx = line.find("stats: ")
        if idx < 0:
            continue
        cur = {}
        for tok in line[idx + len("stats: "):].split():
            name, eq, value = tok.partition("=")
            if eq and value.isdigit():
                cur[name] = int(value)
        if cur:
            stats = cur
    return stats


def http_get(port, path, method="GET", timeout=10.0):
    """(status, headers dict, body bytes) of one request to 127.0.0.1:port."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path)
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


SAMPLE_RE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})? (\S+)$')


def parse_exposition(text):
    """{(name, labels text): value} of a Prometheus text exposition; labels text is "" or
    '{a="b",...}' as exposed. A line that is not a sample, or a sample exposed twice, fails."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = SAMPLE_RE.match(line)
        if m is None:
            raise AssertionError("not a sample line: %r" % line)
        key = (m.group(1), m.group(2) or "")
        if key in out:
            raise AssertionError("sample twice: %r" % (key,))
        out[key] = float(m.group(3))
    return out


def scrape(port):
    """(text, parse_exposition(text)) of the /metrics on 127.0.0.1:port; it must answer 200 in
    the text format."""
    status, headers, body = http_get(port, "/metrics")
    assert status == 200, (status, body[:200])
    assert headers["Content-Type"].startswith("text/plain; version=0.0.4"), headers
    return body.decode(), parse_exposition(body.decode())


def metric(port, name):
    """The value of the unlabelled sample `name` on the /metrics of a daemon whose metrics
    listener is 127.0.0.1:port (None when it has no such sample)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        body = conn.getresponse().read().decode()
    finally:
        conn.close()
    m = re.search(r"^%s (\d+)$" % re.escape(name), body, re.M)
    return int(m.group(1)) if m else None


def spool_record_bytes(spool_dir):
    """Bytes of records in the spool's segment files (their 32-byte headers left out)."""
    total = 0
    try:
        names = os.listdir(spool_dir)
    except FileNotFoundError:
        return 0
    for name in names:
        if name.startswith("spool-") and name.endswith(".seg"):
            try:
                total += max(0, os.path.getsize(os.path.join(spool_dir, name)) - 32)
            except FileNotFoundError:
                pass
    return total


def log_tail(text, n=60):
    lines = text.splitlines()
    return "\n".join(lines[-n:])


# ---------------------------------------------------------------------------------------------
# The MongoDB side
# ---------------------------------------------------------------------------------------------

def start_mongo(**options):
    """The test server (or BUCKETD_TEST_MONGODB_URI) from tests/e2e/mongo_fixture.py;
    options: its strictness switches (mongo_fixture.start_mongo)."""
    try:
        import mongo_fixture
    except ImportError as e:
        raise RuntimeError("tests/e2e/mongo_fixture.py is missing or broken: %s" % e)
    return mongo_fixture.start_mongo(**options)


def unique_db_name(prefix):
    try:
        import mongo_fixture
        return mongo_fixture.unique_db_name(prefix)
    except (ImportError, AttributeError):
        return "%s_%d_%d" % (prefix, os.getpid(), int(time.time() * 1000) % 10**9)


def mongo_client(uri, timeout_ms=10000):
    import pymongo
    return pymongo.MongoClient(uri, serverSelectionTimeoutMS=timeout_ms, connect=True)


def stored_count(client, database, collection="buckets"):
    """Sum of the count fields of every bucket document."""
    total = 0
    for d in client[database][collection].find({}, {"count": 1}):
        total += int(d.get("count", 0))
    return total


def wait_stored(client, database, n, timeout, collection="buckets"):
    """Wait until the documents hold n readings; returns the last total seen."""
    last = [0]

    def done():
        last[0] = stored_count(client, database, collection)
        return last[0] >= n

    wait_for(done, timeout, 0.2)
    return last[0]


# ---------------------------------------------------------------------------------------------
# The daemon
# ---------------------------------------------------------------------------------------------

def proc_status_kib(pid, key):
    """A "key: N kB" line of /proc/<pid>/status, in KiB (None when the process is gone)."""
    try:
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


def rss_not_applicable(pid):
    """Why the daemon's RSS does not measure its own memory here, or None."""
    try:
        exe = os.path.basename(os.readlink("/proc/%d/exe" % pid))
    except OSError:
        exe = ""
    if "qemu" in exe:
        return "the daemon runs under an emulator (%s)" % exe
    with open(BIN, "rb") as f:
        image = f.read()
    for symbol, name in ((b"__asan_init", "AddressSanitizer"),
                         (b"__tsan_init", "ThreadSanitizer"),
                         (b"__msan_init", "MemorySanitizer")):
        if symbol in image:
            return "%s build (shadow memory, freed memory held in quarantine)" % name
    return None


class DaemonError(AssertionError):
    pass


class Daemon:
    """One bucketd process with its own config, log and spool under workdir.

    listeners: list of dicts {"name", "proto", "format", "precision"}; each gets a free
    loopback port, see .addr(name). extra: dict deep-merged into the generated config.
    create_spool: make spool.dir before the start (False: leave it to the daemon).
    """

    DEFAULT_LISTENERS = (
        {"name": "udp", "proto": "udp", "format": "influx", "precision": "ns"},
        {"name": "tcp", "proto": "tcp", "format": "influx", "precision": "ns"},
    )

    def __init__(self, workdir, mongo_uri, database, collection="buckets", listeners=None,
                 max_readings=3600, flush_interval="200ms", extra=None, create_spool=True,
                 env=None):
        self.workdir = workdir
        self.env = env  # extra environment variables for the process
        self.create_spool = create_spool
        self.database = database
        self.collection = collection
        self.listeners = []
        for spec in (listeners or self.DEFAULT_LISTENERS):
            spec = dict(spec)
            spec.setdefault("format", "influx")
            spec.setdefault("precision", "ns")
            spec["port"] = free_port(spec["proto"])
            spec.setdefault("name", "%s-%d" % (spec["proto"], len(self.listeners)))
            self.listeners.append(spec)
        cfg = {
            "writer_id": "e2e-%d" % os.getpid(),
            "listeners": [
                {"proto": l["proto"], "bind": "127.0.0.1:%d" % l["port"],
                 "format": l["format"], "precision": l["precision"]}
                for l in self.listeners
            ],
            "sink": "mongodb",
            "mongodb": {"uri": mongo_uri, "database": database, "collection": collection},
            "buckets": {"span": "1h", "max_readings": max_readings},
            # max_delay 0: every page is written at every flush, so documents show up within
            # the flush interval (tests that check holding set it themselves).
            "flush": {"interval": flush_interval, "stop_timeout": "20s", "max_delay": "0s"},
            "spool": {"dir": os.path.join(workdir, "spool")},
            "metrics": {"bind": ""},
            "log": {"level": "info"},
            # The wall clock trusted at once: these tests stamp readings with the test machine's
            # clock, which its kernel may call unsynchronised (a container, a host without NTP);
            # test_clock.py and test_clock_hold.py play the clock and set the key themselves.
            "time": {"wait_for_sync": "0s"},
            # The default limits.memory (64 MiB): these tests check correctness, not overload.
        }
        self.config = deep_merge(cfg, extra)
        self.config_path = os.path.join(workdir, "bucketd.yaml")
        self.log_path = os.path.join(workdir, "bucketd.log")
        self.proc = None
        self.returncode = None
        self.stop_seconds = None
        self._logf = None

    # -- addresses ------------------------------------------------------------------------
    def addr(self, name):
        for l in self.listeners:
            if l["name"] == name:
                return ("127.0.0.1", l["port"])
        raise KeyError(name)

    # -- lifecycle ------------------------------------------------------------------------
    def write_config(self):
        os.makedirs(self.workdir, exist_ok=True)
        spool = self.config.get("spool", {}).get("dir")
        if spool and self.create_spool:
            os.makedirs(spool, exist_ok=True)
        with open(self.config_path, "w") as f:
            f.write(to_yaml(self.config) + "\n")
        return self.config_path

    def log(self):
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode("utf-8", "replace")
        except FileNotFoundError:
            return ""

    def fail(self, msg):
        raise DaemonError("%s\n--- config %s ---\n%s\n--- log %s (tail) ---\n%s" % (
            msg, self.config_path, to_yaml(self.config), self.log_path, log_tail(self.log())))

    def start(self, ready_timeout=20.0):
        if not os.access(BIN, os.X_OK):
            raise DaemonError("bucketd binary not found at %s (set BUCKETD_BIN)" % BIN)
        self.write_config()
        self._logf = open(self.log_path, "wb")
        env = dict(os.environ, **self.env) if self.env else None
        self.proc = subprocess.Popen([BIN, "-c", self.config_path], stdin=subprocess.DEVNULL,
                                     stdout=self._logf, stderr=subprocess.STDOUT,
                                     cwd=self.workdir, env=env)
        ok = wait_for(lambda: self.proc.poll() is not None or READY_RE.search(self.log()),
                      ready_timeout)
        if self.proc.poll() is not None:
            self.returncode = self.proc.returncode
            self.fail("bucketd exited with %s before logging 'ready'" % self.proc.returncode)
        if not ok:
            self.fail("bucketd did not log 'ready' within %.0fs" % ready_timeout)
        return self

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def reload(self, text=None, expect="reload complete", timeout=60.0):
        """Write the config (self.config, or text as is), send SIGHUP and wait until the log
        holds `expect` once more than before. Returns the log written since the signal."""
        before = self.log()
        if text is None:
            self.write_config()
        else:
            with open(self.config_path, "w") as f:
                f.write(text)
        self.proc.send_signal(signal.SIGHUP)
        had = before.count(expect)
        if not wait_for(lambda: self.log().count(expect) > had or not self.alive(), timeout):
            self.fail("no %r in the log within %.0fs of SIGHUP" % (expect, timeout))
        if not self.alive():
            self.fail("bucketd exited after SIGHUP")
        return self.log()[len(before):]

    def stop(self, timeout=60.0, sig=signal.SIGTERM, expect_rc=0):
        """Signal the daemon, wait for it to exit; returns the stats dict (or None)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            t0 = time.monotonic()
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                self._close_log()
                self.fail("bucketd did not exit within %.0fs of signal %d" % (timeout, sig))
            self.stop_seconds = time.monotonic() - t0
        self.returncode = self.proc.returncode
        self._close_log()
        if expect_rc is not None and self.returncode != expect_rc:
            self.fail("bucketd exited with %s, expected %s" % (self.returncode, expect_rc))
        return self.stats()

    def kill(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._close_log()

    def _close_log(self):
        if self._logf is not None:
            self._logf.close()
            self._logf = None

    def stats(self):
        return parse_stats(self.log())

    def require_stats(self):
        st = self.stats()
        if st is None:
            self.fail("no 'stats:' line in the log")
        return st

    def log_lines(self, min_priority=None, max_priority=None):
        """Log lines whose syslog prefix <N> is within [min, max] (lower N = more severe)."""
        out = []
        for line in self.log().splitlines():
            m = LOG_PREFIX_RE.match(line)
            if not m:
                continue
            p = int(m.group(1))
            if min_priority is not None and p < min_priority:
                continue
            if max_priority is not None and p > max_priority:
                continue
            out.append(line)
        return out


def run_bucketd(args, timeout=30):
    """Run bucketd with args (a list) to completion; returns (rc, combined output)."""
    p = subprocess.run([BIN] + list(args), stdin=subprocess.DEVNULL, capture_output=True,
                       timeout=timeout)
    return p.returncode, (p.stdout + p.stderr).decode("utf-8", "replace")


# ---------------------------------------------------------------------------------------------
# Document checks
# ---------------------------------------------------------------------------------------------

SUMMARY_KEYS = ("min", "max", "sum", "count", "avg")


def _is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _close(a, b, rel=1e-9):
    if not _is_number(a) or not _is_number(b):
        return False
    if a == b:
        return True
    return math.isclose(float(a), float(b), rel_tol=rel, abs_tol=1e-12)


def _page_groups(docs):
    groups = {}
    for d in docs:
        key = (d.get("sensor_id"), _start_key(d))
        groups.setdefault(key, []).append(d)
    return groups


def _start_key(d):
    bs = d.get("bucket_start")
    return dt_ms(bs) if isinstance(bs, datetime.datetime) else bs


def check_documents(docs, span_s, max_readings, strict_pages=True, max_page=100000,
                    max_bytes=128 * 1024):
    """Every invariant of bucket documents (DESIGN.md §3); returns a list of problems.

    strict_pages: the pages of one sensor's bucket are 0..k and all but the last are full
    (true for one writer filling pages in order): max_readings readings, or closed by the
    byte cap, buckets.max_bytes (the daemon's estimate is an upper bound of the BSON size,
    so a page closed by bytes is at least half of it).
    """
    problems = []
    span_ms = span_s * 1000

    def bad(d, msg):
        problems.append("%s: %s" % (d.get("_id"), msg))

    for d in docs:
        sid = d.get("sensor_id")
        if not isinstance(sid, str) or not sid:
            bad(d, "sensor_id missing or not a string: %r" % (sid,))
            continue
        meta = d.get("meta")
        if not isinstance(meta, dict) or not isinstance(meta.get("measurement"), str):
            bad(d, "meta.measurement missing: %r" % (meta,))
        elif not isinstance(meta.get("tags", {}), dict):
            bad(d, "meta.tags is not a document: %r" % (meta.get("tags"),))
        bs, be = d.get("bucket_start"), d.get("bucket_end")
        if not isinstance(bs, datetime.datetime) or not isinstance(be, datetime.datetime):
            bad(d, "bucket_start/bucket_end not dates: %r %r" % (bs, be))
            continue
        bs_ms, be_ms = dt_ms(bs), dt_ms(be)
        if bs_ms % span_ms:
            bad(d, "bucket_start %s not aligned to %ds" % (bs, span_s))
        if be_ms != bs_ms + span_ms - 1:
            bad(d, "bucket_end %s != bucket_start + span - 1ms" % be)
        page = d.get("page")
        if not isinstance(page, int) or isinstance(page, bool) or page < 0 or page > max_page:
            bad(d, "bad page %r" % (page,))
            continue
        want_id = "%s|%d|%d" % (sid, bs_ms // 1000, page)
        if d.get("_id") != want_id:
            bad(d, "_id %r != %r" % (d.get("_id"), want_id))
        readings = d.get("readings")
        if not isinstance(readings, list):
            bad(d, "readings is not an array")
            continue
        count = d.get("count")
        if not isinstance(count, int) or isinstance(count, bool):
            bad(d, "count %r is not an integer" % (count,))
        elif count != len(readings):
            bad(d, "count %d != len(readings) %d" % (count, len(readings)))
        else:
            try:
                from bson.int64 import Int64
                if not isinstance(count, Int64):
                    bad(d, "count is %s, not int64" % type(count).__name__)
            except ImportError:
                pass
        if len(readings) > max_readings:
            bad(d, "%d readings > max_readings %d" % (len(readings), max_readings))
        if not readings:
            bad(d, "no readings")
        prev = None
        fields = {}
        for i, r in enumerate(readings):
            ts = r.get("ts") if isinstance(r, dict) else None
            if not isinstance(ts, datetime.datetime):
                bad(d, "readings[%d] has no date ts: %r" % (i, r))
                continue
            t = dt_ms(ts)
            if prev is not None and t < prev[0]:
                bad(d, "readings not time-ordered at index %d (%s after %s)" % (i, ts, prev[1]))
            prev = (t, ts)
            if not bs_ms <= t <= be_ms:
                bad(d, "readings[%d].ts %s outside [%s, %s]" % (i, ts, bs, be))
            for k, v in r.items():
                if k == "ts":
                    continue
                if isinstance(v, str):
                    bad(d, "readings[%d].%s is a string (strings must be dropped)" % (i, k))
                    continue
                fields.setdefault(k, []).append(v)
        summary = d.get("summary", {})
        if not isinstance(summary, dict):
            bad(d, "summary is not a document")
            continue
        for k, vals in fields.items():
            if all(isinstance(v, bool) for v in vals):
                if k in summary:
                    bad(d, "bool field %s has a summary" % k)
                continue
            nums = [v for v in vals if _is_number(v)]
            if len(nums) != len(vals):
                bad(d, "field %s mixes numbers and other values" % k)
                continue
            s = summary.get(k)
            if not isinstance(s, dict):
                bad(d, "numeric field %s has no summary" % k)
                continue
            missing = [x for x in SUMMARY_KEYS if x not in s]
            if missing:
                bad(d, "summary.%s lacks %s" % (k, missing))
                continue
            want_sum = math.fsum(float(v) for v in nums)
            if s["count"] != len(nums) or isinstance(s["count"], bool):
                bad(d, "summary.%s.count %r != %d" % (k, s["count"], len(nums)))
            if s["min"] != min(nums) or s["max"] != max(nums):
                bad(d, "summary.%s min/max %r/%r != %r/%r" % (k, s["min"], s["max"],
                                                              min(nums), max(nums)))
            if not _close(s["sum"], want_sum):
                bad(d, "summary.%s.sum %r != %r" % (k, s["sum"], want_sum))
            if not _close(s["avg"], want_sum / len(nums)):
                bad(d, "summary.%s.avg %r != %r" % (k, s["avg"], want_sum / len(nums)))
        for k in summary:
            if k not in fields:
                bad(d, "summary.%s for a field no reading has" % k)

    if strict_pages:
        for (sid, start), group in _page_groups(docs).items():
            pages = sorted(g.get("page") for g in group
                           if isinstance(g.get("page"), int))
            if pages != list(range(len(pages))):
                problems.append("%s @%s: pages %s are not 0..k" % (sid, start, pages))
                continue
            by_page = {g["page"]: g for g in group}
            for p in pages[:-1]:
                n = len(by_page[p].get("readings") or [])
                size = len(bson.encode(by_page[p]))
                if n != max_readings and not (n < max_readings and size * 2 >= max_bytes):
                    problems.append("%s: page %d of %d holds %d readings, not %d (full)" % (
                        by_page[p].get("_id"), p, len(pages), n, max_readings))
    return problems


def check_readings(docs, readings, span_s, key_field="seq", meta_check=True):
    """Every sent reading stored exactly once, in its own bucket, with the right values.

    readings: send_readings.Reading objects. Influx readings are found by their "seq"
    field, graphite ones by their "value" (the sequence number). Returns a list of problems.
    """
    problems = []
    expected = {}
    for r in readings:
        k = (r.sensor_id, r.seq)
        if k in expected:
            raise ValueError("duplicate reading key %r in the sent set" % (k,))
        expected[k] = r
    seen = set()
    extra = 0
    span_ms = span_s * 1000
    for d in docs:
        sid = d.get("sensor_id")
        bs = d.get("bucket_start")
        bs_ms = dt_ms(bs) if isinstance(bs, datetime.datetime) else None
        for r in d.get("readings") or []:
            if not isinstance(r, dict):
                continue
            if "seq" in r:
                seq = r["seq"]
            elif "value" in r and _is_number(r["value"]):
                seq = int(r["value"])
            else:
                extra += 1
                if extra <= 5:
                    problems.append("%s: reading without seq/value: %r" % (d.get("_id"), r))
                continue
            k = (sid, seq)
            if k in seen:
                problems.append("%s: reading seq=%s stored twice" % (d.get("_id"), seq))
                continue
            seen.add(k)
            want = expected.get(k)
            if want is None:
                extra += 1
                if extra <= 5:
                    problems.append("%s: unexpected reading %r" % (d.get("_id"), r))
                continue
            ts = r.get("ts")
            got_ms = dt_ms(ts) if isinstance(ts, datetime.datetime) else None
            if got_ms != want.ts_ms:
                problems.append("%s seq=%d: ts %r != %d ms" % (sid, seq, got_ms, want.ts_ms))
            if bs_ms is not None and bs_ms != want.ts_ms // span_ms * span_ms:
                problems.append("%s seq=%d: in bucket %d, its own is %d" % (
                    sid, seq, bs_ms, want.ts_ms // span_ms * span_ms))
            stored = {f: v for f, v in r.items() if f != "ts"}
            if set(stored) != set(want.fields):
                problems.append("%s seq=%d: fields %s != %s" % (sid, seq, sorted(stored),
                                                                sorted(want.fields)))
            for f, v in want.fields.items():
                if f not in stored:
                    continue
                sv = stored[f]
                if isinstance(v, bool):
                    ok = isinstance(sv, bool) and sv == v
                elif isinstance(v, float):
                    ok = isinstance(sv, float) and sv == v
                else:
                    ok = _is_number(sv) and sv == v
                    if ok and f in ("seq", "hum") and not isinstance(sv, int):
                        ok = False
                if not ok:
                    problems.append("%s seq=%d: %s=%r (%s), sent %r" % (
                        sid, seq, f, sv, type(sv).__name__, v))
            if meta_check and want.fmt == "influx":
                meta = d.get("meta") or {}
                if meta.get("measurement") != want.measurement or \
                        meta.get("tags") != want.tags:
                    problems.append("%s: meta %r != measurement %r tags %r" % (
                        d.get("_id"), meta, want.measurement, want.tags))
                    meta_check = False  # report once
    missing = [k for k in expected if k not in seen]
    if missing:
        problems.append("%d of %d readings missing, e.g. %s" % (
            len(missing), len(expected), ", ".join("%s seq=%d" % k for k in missing[:5])))
    if extra:
        problems.append("%d stored readings were never sent" % extra)
    return problems


def format_problems(problems, limit=30):
    head = problems[:limit]
    more = len(problems) - len(head)
    return "\n".join(head) + ("\n... and %d more" % more if more > 0 else "")


# ---------------------------------------------------------------------------------------------
# unittest base
# ---------------------------------------------------------------------------------------------

class E2ECase(unittest.TestCase):
    """One test server per class (started on first use), one database per test."""

    mongo = None
    db_prefix = "bdtest"
    # The test server's strictness switches for this class (mongo_fixture.start_mongo),
    # e.g. {"sharded": "sensor_id:1,bucket_start:1"}.
    mongo_options = {}

    @classmethod
    def tearDownClass(cls):
        if cls.mongo is not None:
            cls.mongo.stop()
            cls.mongo = None

    @classmethod
    def mongo_uri(cls):
        if cls.mongo is None:
            cls.mongo = start_mongo(**cls.mongo_options)
        return cls.mongo.uri

    def setUp(self):
        self.workdir = tempfile.mkdtemp(prefix="bucketd-e2e-")
        self.daemons = []
        self.databases = []
        self.clients = []

    def tearDown(self):
        for d in self.daemons:
            d.kill()
        for client, name in self.databases:
            try:
                client.drop_database(name)
            except Exception:  # the server may be gone; the database dies with it
                pass
        for c in self.clients:
            c.close()
        if os.environ.get("BUCKETD_E2E_KEEP"):
            sys.stderr.write("\nkept %s\n" % self.workdir)
        else:
            shutil.rmtree(self.workdir, ignore_errors=True)

    # -- helpers --------------------------------------------------------------------------
    def new_database(self, prefix=None):
        uri = self.mongo_uri()
        name = unique_db_name(prefix or self.db_prefix)
        client = mongo_client(uri)
        self.clients.append(client)
        self.databases.append((client, name))
        return uri, client, name

    def daemon(self, uri, database, name="d", **kw):
        d = Daemon(os.path.join(self.workdir, name), uri, database, **kw)
        self.daemons.append(d)
        return d

    def documents(self, client, database, collection="buckets"):
        return list(client[database][collection].find({}).sort("_id", 1))

    def assertNoProblems(self, problems, what, daemon=None):
        if problems:
            msg = "%s: %d problems\n%s" % (what, len(problems), format_problems(problems))
            if daemon is not None:
                msg += "\n--- log tail %s ---\n%s" % (daemon.log_path,
                                                       log_tail(daemon.log(), 30))
            self.fail(msg)

    def assertStat(self, stats, name, want, daemon=None):
        got = (stats or {}).get(name)
        if got != want:
            msg = "stats %s=%r, expected %r\nstats: %r" % (name, got, want, stats)
            if daemon is not None:
                msg += "\n--- log tail %s ---\n%s" % (daemon.log_path,
                                                       log_tail(daemon.log(), 30))
            self.fail(msg)


# ---- shared by the exactly-once, spool and document-model tests ----------------------------


def inspect_verify(uri, database, max_readings, span="1h"):
    p = subprocess.run([INSPECT, "--uri", uri, "--database", database, "verify",
                        "--max-readings", str(max_readings), "--span", span],
                       stdin=subprocess.DEVNULL, capture_output=True, timeout=300)
    return p.returncode, (p.stdout + p.stderr).decode("utf-8", "replace")


def with_uri_options(uri, **opts):
    parts = urllib.parse.urlsplit(uri)
    query = dict(urllib.parse.parse_qsl(parts.query))
    query.update({k: str(v) for k, v in opts.items()})
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, parts.path or "/",
                                    urllib.parse.urlencode(query), ""))


def primary_hostport(client, uri):
    """Where writes go: a replica set's primary, else the URI's first host."""
    primary = client.admin.command("hello").get("primary")
    if primary:
        host, _, port = primary.rpartition(":")
        return host.strip("[]"), int(port)
    netloc = urllib.parse.urlsplit(uri).netloc.rsplit("@", 1)[-1]
    host, _, port = netloc.split(",")[0].rpartition(":")
    return host.strip("[]"), int(port)


def start_fault_proxy(case, uri, client, **uri_opts):
    """A fault proxy (tests/fault_proxy.py) in front of the server that takes writes, stopped
    when the test ends, and the URI a daemon uses to go through it: direct connection, short
    timeouts (uri_opts replace any of them)."""
    import fault_proxy  # tests/fault_proxy.py (tests/ is on the path, above)
    proxy = fault_proxy.FaultProxy(*primary_hostport(client, uri), upstream_uri=uri)
    proxy.start()
    case.addCleanup(proxy.stop)
    parts = urllib.parse.urlsplit(uri)
    auth = parts.netloc.rpartition("@")[0]
    netloc = ("%s@" % auth if auth else "") + "127.0.0.1:%d" % proxy.port
    opts = dict(directConnection="true", connectTimeoutMS=1000, serverSelectionTimeoutMS=1000,
                heartbeatFrequencyMS=500)
    opts.update(uri_opts)
    proxied = with_uri_options(
        urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, parts.query, "")), **opts)
    return proxy, proxied
