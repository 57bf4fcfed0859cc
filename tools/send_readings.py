#!/usr/bin/python3
"""Send simulated sensor readings to bucketd over UDP and/or TCP.

Every reading carries a unique integer field ``seq`` (influx) so a test can find each one in
the stored bucket documents, a float field ``temp``, an integer field ``hum`` and, for about
one reading in five, a boolean ``ok``. Graphite has a single field per line, so there the
value itself is the sequence number (``value`` == seq, sent as a float).

Use it as a command line tool (prints one JSON line describing what was sent) or import it:

    readings = make_readings(sensors=10, per_sensor=100, start_ns=..., span_ns=...)
    summary = send(readings, udp=("127.0.0.1", 8089), tcp=None)

Sensors are split over the transports given: with both --udp and --tcp, sensor i goes over
UDP when i is even and TCP when i is odd, so each sensor's readings use one transport.
"""

import argparse
import json
import os
import random
import socket
import sys
import time

NS_PER_MS = 1_000_000
NS_PER_S = 1_000_000_000
HOUR_NS = 3600 * NS_PER_S

# Conservative datagram size: well under the loopback MTU and any listener's line limit.
MAX_DATAGRAM = 8192
TCP_CHUNK = 32 * 1024


class Reading:
    """One simulated reading: what is sent (line) and what must be stored (fields)."""

    __slots__ = ("sensor", "sensor_id", "measurement", "tags", "seq", "ts_ns", "fields",
                 "line", "fmt")

    def __init__(self, sensor, sensor_id, measurement, tags, seq, ts_ns, fields, line, fmt):
        self.sensor = sensor          # index of the sensor (0..N-1)
        self.sensor_id = sensor_id    # the id bucketd must derive (series key / path)
        self.measurement = measurement
        self.tags = tags              # dict
        self.seq = seq                # unique over every reading made by one make_readings()
        self.ts_ns = ts_ns
        self.fields = fields          # dict field -> Python value as it must be stored
        self.line = line              # bytes, without the newline
        self.fmt = fmt

    @property
    def ts_ms(self):
        return self.ts_ns // NS_PER_MS

    def bucket_start_s(self, span_s):
        return (self.ts_ns // NS_PER_S) // span_s * span_s

    def __repr__(self):
        return "Reading(%s seq=%d ts=%d)" % (self.sensor_id, self.seq, self.ts_ns)


def _influx_sensor(prefix, i):
    """Measurement and tags of influx sensor i. Tags are written unsorted on purpose."""
    measurement = prefix
    tags = {"sensor": "s%03d" % i, "site": "lab%d" % (i % 3), "room": "r%02d" % (i % 7)}
    # On the wire: site, sensor, room (not sorted); the series key sorts them.
    wire_order = ["site", "sensor", "room"]
    head = measurement + "".join(",%s=%s" % (k, tags[k]) for k in wire_order)
    sensor_id = measurement + "".join(",%s=%s" % (k, tags[k]) for k in sorted(tags))
    return measurement, tags, head, sensor_id


def _graphite_sensor(prefix, i):
    """Path and tags of graphite sensor i; odd sensors carry tags written unsorted."""
    path = "%s.s%03d.temp" % (prefix, i)
    if i % 2:
        tags = {"site": "lab%d" % (i % 3), "room": "r%02d" % (i % 7)}
        head = path + ";site=%s;room=%s" % (tags["site"], tags["room"])
        sensor_id = path + "".join(";%s=%s" % (k, tags[k]) for k in sorted(tags))
    else:
        tags = {}
        head = path
        sensor_id = path
    return path, tags, head, sensor_id


def make_readings(sensors=10, per_sensor=100, start_ns=None, span_ns=None, fmt="influx",
                  seed=1, prefix=None, seq_base=0, bool_every=5, unsigned=False,
                  string_every=0, sensor_base=0):
    """Build sensors * per_sensor readings (not shuffled: sensor-major, time-ordered).

    Timestamps of each sensor are spread evenly over [start_ns, start_ns + span_ns) with a
    little jitter, aligned to the millisecond for influx and to the second for graphite (whose
    listeners normally use precision s). Defaults: the 3 hours up to one minute ago.

    bool_every: every n-th reading of a sensor carries ``ok=<bool>`` (0: never).
    unsigned: add ``cnt=<n>u`` to every reading.
    string_every: every n-th reading carries a string field ``note`` (dropped by bucketd).
    """
    rnd = random.Random(seed)
    now = time.time_ns()
    if span_ns is None:
        span_ns = 3 * HOUR_NS - 2 * 60 * NS_PER_S
    if start_ns is None:
        start_ns = now - span_ns - 60 * NS_PER_S
    if prefix is None:
        prefix = "climate" if fmt == "influx" else "plant"
    unit = NS_PER_MS if fmt == "influx" else NS_PER_S
    out = []
    seq = seq_base
    for si in range(sensor_base, sensor_base + sensors):
        if fmt == "influx":
            measurement, tags, head, sensor_id = _influx_sensor(prefix, si)
        elif fmt == "graphite":
            measurement, tags, head, sensor_id = _graphite_sensor(prefix, si)
        else:
            raise ValueError("unknown format %r" % fmt)
        step = span_ns // max(per_sensor, 1)
        used = set()
        for k in range(per_sensor):
            base = start_ns + k * step
            ts = base + rnd.randrange(0, max(step // 2, 1))
            ts = ts // unit * unit
            while ts in used:  # unique timestamps per sensor keep the expected order exact
                ts += unit
            used.add(ts)
            seq += 1
            if fmt == "influx":
                temp = round(rnd.uniform(-20.0, 45.0), rnd.choice((1, 2, 3, 6)))
                hum = rnd.randrange(0, 101)
                fields = {"temp": temp, "hum": hum, "seq": seq}
                parts = ["temp=%r" % temp, "hum=%di" % hum, "seq=%di" % seq]
                if bool_every and k % bool_every == bool_every - 1:
                    ok = rnd.random() < 0.5
                    fields["ok"] = ok
                    parts.append("ok=%s" % rnd.choice(("true", "t", "T", "True", "TRUE"))
                                 if ok else "ok=%s" % rnd.choice(("false", "f", "F", "False")))
                if unsigned:
                    cnt = rnd.randrange(0, 1 << 40)
                    fields["cnt"] = cnt
                    parts.append("cnt=%du" % cnt)
                if string_every and k % string_every == string_every - 1:
                    parts.append('note="reading %d"' % seq)
                rnd.shuffle(parts)
                line = "%s %s %d" % (head, ",".join(parts), ts)
            else:
                value = float(seq)
                fields = {"value": value}
                line = "%s %d %d" % (head, seq, ts // NS_PER_S)
            out.append(Reading(si, sensor_id, measurement, tags, seq, ts, fields,
                               line.encode(), fmt))
    return out


def shuffle(readings, seed=1):
    """Out-of-order copy of readings (deterministic for a seed)."""
    r = list(readings)
    random.Random(seed).shuffle(r)
    return r


def split_late(readings, fraction=0.05, seed=1):
    """Pick about `fraction` of the readings older than the newest hour to send last.

    Returns (main, late): `late` holds readings from the hours before the newest one present,
    to be sent after the newer ones have been flushed, so they land in older, already written
    buckets. (Not only the oldest hour: how much of it the readings cover depends on the
    minute the test runs.)
    """
    if not readings or fraction <= 0:
        return list(readings), []
    last_hour = max(r.ts_ns for r in readings) // HOUR_NS
    rnd = random.Random(seed)
    main, late = [], []
    for r in readings:
        if r.ts_ns // HOUR_NS < last_hour and rnd.random() < fraction:
            late.append(r)
        else:
            main.append(r)
    return main, late


def parse_hostport(s):
    if s.startswith("["):
        host, _, port = s[1:].partition("]:")
    else:
        host, _, port = s.rpartition(":")
    if not host or not port:
        raise ValueError("expected HOST:PORT, got %r" % s)
    return host, int(port)


def _family(host):
    return socket.AF_INET6 if ":" in host else socket.AF_INET


class Sender:
    """Sends lines over one UDP socket and/or one TCP connection, counting what went out."""

    def __init__(self, udp=None, tcp=None, lines_per_datagram=1, pace_every=200,
                 pace_sleep=0.002):
        self.udp_addr = udp
        self.tcp_addr = tcp
        self.lines_per_datagram = max(1, lines_per_datagram)
        self.pace_every = pace_every
        self.pace_sleep = pace_sleep
        self.udp_sock = None
        self.tcp_sock = None
        self.udp_pending = []
        self.udp_pending_bytes = 0
        self.tcp_buf = bytearray()
        self.stats = {
            "udp": {"readings": 0, "datagrams": 0, "bytes": 0},
            "tcp": {"readings": 0, "connections": 0, "bytes": 0},
        }
        if udp:
            self.udp_sock = socket.socket(_family(udp[0]), socket.SOCK_DGRAM)
        if tcp:
            self.tcp_sock = socket.create_connection(tcp, timeout=30)
            self.stats["tcp"]["connections"] += 1

    # -- UDP ----------------------------------------------------------------------------
    def datagram(self, payload):
        """Send one raw datagram (bytes), paced."""
        self.udp_sock.sendto(payload, self.udp_addr)
        st = self.stats["udp"]
        st["datagrams"] += 1
        st["bytes"] += len(payload)
        if self.pace_every and st["datagrams"] % self.pace_every == 0:
            time.sleep(self.pace_sleep)

    def _udp_flush(self):
        if self.udp_pending:
            self.datagram(b"\n".join(self.udp_pending) + b"\n")
            self.udp_pending = []
            self.udp_pending_bytes = 0

    def udp_line(self, line, readings=1):
        if self.udp_pending and (len(self.udp_pending) >= self.lines_per_datagram or
                                 self.udp_pending_bytes + len(line) + 1 > MAX_DATAGRAM):
            self._udp_flush()
        self.udp_pending.append(line)
        self.udp_pending_bytes += len(line) + 1
        self.stats["udp"]["readings"] += readings
        if len(self.udp_pending) >= self.lines_per_datagram:
            self._udp_flush()

    # -- TCP ----------------------------------------------------------------------------
    def tcp_raw(self, data):
        self.tcp_buf += data
        if len(self.tcp_buf) >= TCP_CHUNK:
            self._tcp_flush()

    def _tcp_flush(self):
        if self.tcp_buf:
            self.tcp_sock.sendall(self.tcp_buf)
            self.stats["tcp"]["bytes"] += len(self.tcp_buf)
            self.tcp_buf = bytearray()

    def tcp_line(self, line, readings=1):
        self.tcp_raw(line + b"\n")
        self.stats["tcp"]["readings"] += readings

    # -- both ---------------------------------------------------------------------------
    def send_reading(self, r):
        """Send one Reading on the transport its sensor is assigned to."""
        use_udp = self.udp_sock is not None and (self.tcp_sock is None or r.sensor % 2 == 0)
        if use_udp:
            self.udp_line(r.line)
        else:
            self.tcp_line(r.line)

    def flush(self):
        if self.udp_sock is not None:
            self._udp_flush()
        if self.tcp_sock is not None:
            self._tcp_flush()

    def close(self):
        self.flush()
        if self.tcp_sock is not None:
            try:
                self.tcp_sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            self.tcp_sock.close()
            self.tcp_sock = None
        if self.udp_sock is not None:
            self.udp_sock.close()
            self.udp_sock = None

    def summary(self):
        u, t = self.stats["udp"], self.stats["tcp"]
        return {
            "readings": u["readings"] + t["readings"],
            "datagrams": u["datagrams"],
            "bytes": u["bytes"] + t["bytes"],
            "udp": dict(u),
            "tcp": dict(t),
        }

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def send(readings, udp=None, tcp=None, lines_per_datagram=1, late=(), late_delay=0.0,
         pace_every=200, pace_sleep=0.002):
    """Send readings (in the order given), then, after late_delay seconds, the late ones.

    udp/tcp are (host, port) tuples or None. Returns the summary dict.
    """
    if not udp and not tcp:
        raise ValueError("need a UDP or TCP destination")
    with Sender(udp, tcp, lines_per_datagram, pace_every, pace_sleep) as s:
        for r in readings:
            s.send_reading(r)
        s.flush()
        if late:
            time.sleep(late_delay)
            for r in late:
                s.send_reading(r)
            s.flush()
        return s.summary()


def main(argv=None):
    ap = argparse.ArgumentParser(description="Send simulated sensor readings to bucketd.")
    ap.add_argument("--udp", metavar="HOST:PORT", help="send datagrams here")
    ap.add_argument("--tcp", metavar="HOST:PORT", help="send a line stream here")
    ap.add_argument("--sensors", type=int, default=10, help="number of sensors (default 10)")
    ap.add_argument("--readings", type=int, default=100, help="readings per sensor (100)")
    ap.add_argument("--start-ns", type=int, default=None,
                    help="first timestamp in ns (default: span before one minute ago)")
    ap.add_argument("--span", default="3h",
                    help="time range covered, e.g. 3h, 90m, 600s, or plain ns (default 3h)")
    ap.add_argument("--lines-per-datagram", type=int, default=1,
                    help="lines packed in one UDP datagram (default 1)")
    ap.add_argument("--format", choices=("influx", "graphite"), default="influx")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--prefix", default=None, help="measurement name / path prefix")
    ap.add_argument("--sensor-base", type=int, default=0, help="first sensor number (0)")
    ap.add_argument("--seq-base", type=int, default=0,
                    help="sequence numbers start after this (default 0)")
    ap.add_argument("--ordered", action="store_true", help="do not shuffle the readings")
    ap.add_argument("--late-fraction", type=float, default=0.0,
                    help="share of the oldest hour's readings held back and sent last")
    ap.add_argument("--late-delay", type=float, default=0.5,
                    help="seconds to wait before sending the held-back readings")
    args = ap.parse_args(argv)
    if not args.udp and not args.tcp:
        ap.error("give --udp HOST:PORT and/or --tcp HOST:PORT")

    span = args.span.strip()
    units = {"ns": 1, "us": 1000, "ms": NS_PER_MS, "s": NS_PER_S, "m": 60 * NS_PER_S,
             "h": HOUR_NS}
    for suffix in ("ns", "us", "ms", "s", "m", "h"):
        if span.endswith(suffix) and span[:-len(suffix)].isdigit():
            span_ns = int(span[:-len(suffix)]) * units[suffix]
            break
    else:
        if not span.isdigit():
            ap.error("bad --span %r" % args.span)
        span_ns = int(span)
    start_ns = args.start_ns
    if start_ns is None:
        start_ns = time.time_ns() - span_ns - 60 * NS_PER_S

    readings = make_readings(args.sensors, args.readings, start_ns, span_ns, args.format,
                             args.seed, args.prefix, args.seq_base,
                             sensor_base=args.sensor_base)
    if not args.ordered:
        readings = shuffle(readings, args.seed)
    main_part, late = split_late(readings, args.late_fraction, args.seed)
    summary = send(main_part, parse_hostport(args.udp) if args.udp else None,
                   parse_hostport(args.tcp) if args.tcp else None, args.lines_per_datagram,
                   late, args.late_delay)
    summary["sensors"] = args.sensors
    summary["format"] = args.format
    summary["late"] = len(late)
    summary["first_ts_ns"] = min((r.ts_ns for r in readings), default=None)
    summary["last_ts_ns"] = max((r.ts_ns for r in readings), default=None)
    print(json.dumps(summary, sort_keys=True))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
