#!/usr/bin/env python3
"""Writes the seed corpora and dictionaries of the libFuzzer targets in tests/fuzz/.

Every seed is valid input: one byte for the parser (as the targets read it: the low two bits
pick the precision, '0' ns, '1' us, '2' ms, '3' s; '4' to '7' pick the same with the small line
limit), then one or more lines. The line-protocol seeds are the lines below plus, when the
conformance corpus is given, each of its accepted cases; the Graphite seeds are the lines below.
The hand-written lines go in once per line limit. Existing seed directories are emptied first.

    python3 tests/fuzz/make_seeds.py OUT_DIR [--corpus PATH/corpus.json]

writes OUT_DIR/seeds-influx/, OUT_DIR/seeds-graphite/, OUT_DIR/influx.dict and
OUT_DIR/graphite.dict, and for fuzz_accept (the path after the parser) OUT_DIR/seeds-accept/ and
OUT_DIR/accept.dict: the same lines (line protocol '0'-'7', Graphite '8'-'?', and each again with
bit 6 set, a flush after every line), the corpus cases, and batches made for the sensor table and
the update builder: sensor ids from 1 KB to 70 KB and ids sharing long prefixes, field keys of
300 bytes and more sharing long prefixes, names that need the BSON escape ('.', '$', '%', "ts"),
and batches that reach each limit of fuzz_accept's small configuration.
"""

import argparse
import base64
import json
import os
import shutil
import sys

PRECISION_BYTE = {"1ns": b"0", "1\u00b5s": b"1", "1us": b"1", "1ms": b"2", "1s": b"3"}

# (precision byte, text). Each covers one corner of the grammar the parser documents.
INFLUX_LINES = [
    # The plain shapes, with and without tags and timestamps.
    (b"0", "cpu value=1"),
    (b"0", "cpu,host=a,region=eu usage=0.5,idle=99i 1600000000000000000"),
    (b"0", "cpu,region=eu,host=a usage=0.5 1600000000000000000"),
    (b"0", "m,b=2,a=1,c=3 f=1"),
    (b"0", "m f=1,f=2,g=3i,f=4"),
    (b"0", "m   f=1   123"),
    (b"0", "m f=1 -1"),
    (b"0", "m f=1\r"),
    (b"0", "m f=1\r\nm f=2\n"),
    # Escapes in every kind of token, and backslashes that escape nothing.
    (b"0", "my\\ measurement,my\\,tag\\=key=my\\ value\\,x\\=y my\\ field\\=k=1"),
    (b"0", "a\\b,k\\x=v\\y f\\z=1"),
    (b"0", "a\\\\ b,k=v\\\\,w f=1"),
    (b"0", "m=x,k=v f=1"),
    (b"0", "\\ m f=1"),
    (b"0", '"m",k="v" "f"=1'),
    (b"0", "\u00e9t\u00e9,cl\u00e9=\u2603 \U0001f600=1"),
    # Strings: empty, escapes, raw control characters, raw newlines (joined by bucketd-parse).
    (b"0", 'm s=""'),
    (b"0", 'm s="a\\"b\\\\c\\nd\\re\\tf\\xg"'),
    (b"0", 'm s="tab\there, comma, space = equals"'),
    (b"0", 'm s="line one\nline two\nline three" 17'),
    (b"0", 'm s="ends with backslash\\\\",t="x"'),
    (b"0", 'm s="\u00fcnic\u00f8de \u2603"'),
    # Integers and unsigned integers at their limits.
    (b"0", "m i=0i,j=-0i,k=9223372036854775807i,l=-9223372036854775808i"),
    (b"0", "m u=0u,v=18446744073709551615u,w=00042u"),
    (b"0", "m i=-1i,u=1u"),
    # Floats: every form the grammar allows, and the far ends of the double range.
    (b"0", "m a=1,b=-1,c=1.,d=.5,e=-.5,f=1.5e3,g=1.5E-3,h=1e+10,i=-0,j=0.0"),
    (b"0", "m a=1.7976931348623157e308,b=2.2250738585072014e-308,c=4.9e-324,d=1e-400"),
    (b"0", "m a=0.1,b=0.30000000000000004,c=123456789012345678901234567890"),
    (b"0", "m a=9007199254740993,b=1e22,c=1e23,d=12e30,e=0.000000000000000000001"),
    (b"0", "m a=000123.456000,b=-00.00e-00"),
    # Booleans, every spelling.
    (b"0", "m a=t,b=T,c=true,d=True,e=TRUE,f=f,g=F,h=false,i=False,j=FALSE"),
    # Timestamps in every precision, at the edges of their range.
    (b"0", "m f=1 9223372036854775807"),
    (b"0", "m f=1 -9223372036854775808"),
    (b"1", "m f=1 9223372036854775"),
    (b"1", "m f=1 -9223372036854775"),
    (b"2", "m f=1 9223372036854"),
    (b"2", "m f=1 1600000000000"),
    (b"3", "m f=1 9223372036"),
    (b"3", "m f=1 -9223372036"),
    (b"3", "m f=1 1600000000"),
    # Blank and comment lines between points.
    (b"0", "# a comment\n\n   \nm f=1\n#another\nm f=2"),
    (b"0", "   # indented comment \u00e9"),
]

GRAPHITE_LINES = [
    (b"0", "servers.web1.cpu 12.5 1600000000"),
    (b"0", "servers.web1.cpu 12.5"),
    (b"0", "servers.web1.cpu 12 -1"),
    (b"0", "a.b 1 1600000000.123456789"),
    (b"0", "a.b 1 1600000000.5"),
    (b"0", "a.b 1 1600000000.1234567891234"),
    (b"0", "a.b 1 -1.5"),
    (b"0", "a.b 1 0"),
    (b"0", "a.b 1 9223372036.854775807"),
    (b"0", "a.b 1 -9223372036.854775808"),
    # Tags, in and out of order, with '=' in values and carbon's allowed characters.
    (b"0", "disk.used;datacenter=dc1;rack=a1;server=web01 9.5 1600000000"),
    (b"0", "disk.used;server=web01;rack=a1;datacenter=dc1 9.5 1600000000"),
    (b"0", "m;k=v=w;a=b~c;z=1 1"),
    (b"0", "m;k\u00e9=\u2603 1"),
    # Value forms: sign, exponent, no integer part, no fraction part.
    (b"0", "m +1 1"),
    (b"0", "m -1.5e-3 1"),
    (b"0", "m .5 1"),
    (b"0", "m 5. 1"),
    (b"0", "m 1E+300 1"),
    (b"0", "m 4.9e-324 1"),
    (b"0", "m -0 1"),
    (b"0", "m 123456789012345678901234567890 1"),
    # Spaces and tabs, a trailing '\r', comments and blank lines.
    (b"0", "\t m \t 1 \t 1600000000 \t"),
    (b"0", "m 1 1\r"),
    (b"0", "# comment\n\nm 1 1\n  # indented\nn 2"),
    # The precision byte changes nothing for Graphite.
    (b"3", "m 1 1600000000.25"),
]

# Tokens for libFuzzer's -dict: the separators and literals mutations rarely hit by chance.
INFLUX_DICT = [
    b"\\ ", b"\\,", b"\\=", b"\\\\", b'\\"', b"\\n", b'"', b"=", b",", b" ", b"#",
    b"i", b"u", b"-", b".", b"e", b"E+", b"e-", b"t", b"true", b"TRUE", b"False", b"f",
    b"9223372036854775807", b"-9223372036854775808", b"18446744073709551615",
    b"1.7976931348623157e308", b"4.9e-324", b"\r", b"\n", b"\xc3\xa9", b"\xe2\x98\x83",
]
GRAPHITE_DICT = [
    b";", b"=", b" ", b"\t", b"#", b"-1", b"+", b".", b"e", b"E-", b"~", b"!", b"^",
    b"9223372036.854775807", b"-9223372036.854775808", b".123456789", b"1600000000",
    b"\r", b"\n", b"\xc3\xa9",
]


# Tokens for fuzz_accept: the line protocol's, and the names the BSON escape (names.h) rewrites.
ACCEPT_DICT = INFLUX_DICT + [
    b"ts", b"$", b".", b"%", b"%25", b"%2E", b"%2e", b"%24", b"%74s", b"$id", b"a.b",
    b" 1600000000000000000", b" 1599999999999999999", b" 1600000600000000001", b"\n",
]


def accept_seeds():
    """(name, bytes) batches for fuzz_accept, beyond the parser seeds (see the module doc)."""
    ts = 1600000000000000000  # fuzz_accept's fixed "now", in ns
    seeds = []

    def add(name, mode, lines):
        text = "\n".join(lines) if isinstance(lines, list) else lines
        seeds.append((name, mode + text.encode()))
        # The same with a flush after every line: pages fill over several updates.
        seeds.append((name + "-each", bytes([mode[0] | 0x40]) + text.encode()))

    # Sensor ids from 1 KB to 70 KB (measurement, tag value, Graphite path), and two ids that
    # differ only past a long common prefix: each must keep its own _id.
    for size in (1000, 1100, 4096, 16384, 70000):
        add("id-meas-%d" % size, b"0", ["m" * size + " v=1", "m" * size + " v=2i %d" % ts])
        add("id-tag-%d" % size, b"0",
            ["m,k=%s v=1" % ("x" * size), "m,k=%sy v=2" % ("x" * (size - 1))])
        add("id-graphite-%d" % size, b"8",
            ["%s 1 1600000000" % ("a." * (size // 2)), "%sb 2 1600000000" % ("a." * (size // 2))])
    prefix = "sensor-" + "p" * 2000
    add("id-shared-prefix", b"0", ["%s%d v=%d" % (prefix, i, i) for i in range(4)])
    # Around the length where an _id stops holding the id verbatim (bucket.h: 256 bytes), and
    # around the prefix kept before the digest (192), with multi-byte characters at the cut.
    for size in (191, 192, 193, 255, 256, 257, 258):
        add("id-edge-%d" % size, b"0", ["i" * size + " v=1", "i" * (size - 1) + "j v=2"])
        add("id-utf8-%d" % size, b"0",
            ["\u00e9" * (size // 2) + " v=1", "\u20ac" * (size // 3) + "x v=1"])
    # Field keys of 300 bytes and more sharing long prefixes: one summary key each.
    long_key = "f" * 300
    add("keys-shared-prefix", b"0",
        ["m " + ",".join("%s%d=%d" % (long_key, i, i) for i in range(6)),
         "m %sa=1,%sb=2i,%sc=true" % (long_key, long_key, long_key)])
    add("keys-long", b"0", ["m %s=1,%s=2" % ("k" * 1000, "k" * 999 + "l"),
                            "m %s=3" % ("k" * 5000)])
    # Names that need the escape, alone and mixed with the escapes' own text.
    add("names-escape", b"0", [
        "m ts=1,a.b=2,$x=3,%=4,x$=5,.=6,$=7",
        "m %25=1,%2E=2,%24=3,%74s=4,%2e=5,tss=6,t=7",
        "m,a.b=1,$t=2,ts=3,%=4 ts=1i,f.g.h=2u",
        "a.b.c,$k=$v ts=1",
        "m a.b=1,a%2Eb=2",
        "m $ts=1,ts.=2,.ts=3",
    ])
    add("names-escape-graphite", b"8", ["a.b.c;ts=1;$x=y;p.q=%25 1 1600000000", "$.% 2"])
    # The limits of fuzz_accept's small configuration: more sensors than limits.max_sensors,
    # more fields than a sensor may have, more readings than the buffer pool holds, pages
    # filled by count and by bytes, timestamps outside the window, string-only lines.
    add("limit-sensors", b"0", ["s%d v=%d" % (i, i) for i in range(12)])
    add("limit-fields", b"0", ["m f%d=%d" % (i, i) for i in range(70)])
    add("limit-fields-line", b"0", ["m " + ",".join("f%d=1" % i for i in range(40))])
    add("limit-pool", b"0", ["m,k=%d a=%d,b=%di" % (i % 3, i, i) for i in range(700)])
    add("limit-page-count", b"0", ["m v=%d %d" % (i, ts + i) for i in range(30)])
    add("limit-page-bytes", b"0",
        ["m %s=%d %d" % (",".join("g%d%s=1" % (j, "z" * 200) for j in range(6)), i, ts + i)
         for i in range(12)])
    add("limit-window", b"0", ["m v=1 %d" % t for t in (
        ts, ts - 7 * 86400 * 10**9 - 1, ts - 7 * 86400 * 10**9 + 1, ts + 600 * 10**9,
        ts + 600 * 10**9 + 1, 0, -1)])
    add("limit-strings", b"0", ['m s="x"', 'm s="x",v=1', 'm b=true'])
    # Summaries: values falling and rising, ints and floats mixed in one field, unsigned
    # integers past int64, booleans (stored, not summarised).
    add("summaries", b"0", [
        "m v=5,w=1i,u=1u,b=t", "m v=3,w=-2i,u=18446744073709551615u,b=f", "m v=4,w=7i,u=3u",
        "m v=-1.5,w=2.5,u=9223372036854775808u", "m v=-1.5,w=-9223372036854775808i,u=0u",
        "m v=1e308,w=9223372036854775807i", "m v=-0,w=0", "m v=0,w=-0.0"])
    add("late-order", b"0", ["m v=%d %d" % (i, ts - (i % 5) * 3600 * 10**9) for i in range(20)])
    return seeds


def small_limit(prec):
    """The first byte that picks the same precision with the small line limit."""
    return bytes([prec[0] | 4])


def short_key(i):
    """One of 256 distinct two-letter keys, "aa" to "pp"."""
    return chr(ord("a") + i // 16) + chr(ord("a") + i % 16)


def write_seed(directory, name, data):
    with open(os.path.join(directory, name), "wb") as f:
        f.write(data)


def write_dict(path, tokens):
    with open(path, "w", encoding="ascii") as f:
        for tok in tokens:
            f.write('"' + "".join("\\x%02x" % b for b in tok) + '"\n')


def corpus_seeds(path):
    """(name, bytes) for each case the corpus accepts."""
    with open(path, encoding="utf-8") as f:
        cases = json.load(f)["decode"]
    seeds = []
    for key, case in sorted(cases.items()):
        if "result" not in case["output"]:
            continue
        inp = case["input"]
        text = inp["text"]
        data = base64.b64decode(text["binary"]) if isinstance(text, dict) else text.encode()
        prec = PRECISION_BYTE.get(inp.get("precision", "1ns"))
        if prec is None:
            sys.exit("make_seeds: %s: unknown precision %r" % (key, inp.get("precision")))
        seeds.append(("corpus-" + key, prec + data))
    return seeds


def fresh_dir(path):
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", help="directory for seeds-*/ and *.dict (build-fuzz/)")
    ap.add_argument("--corpus", help="the line-protocol conformance corpus.json, if present")
    args = ap.parse_args()

    influx = os.path.join(args.out, "seeds-influx")
    graphite = os.path.join(args.out, "seeds-graphite")
    accept = os.path.join(args.out, "seeds-accept")
    fresh_dir(influx)
    fresh_dir(graphite)
    fresh_dir(accept)

    n_corpus = 0
    for i, (prec, text) in enumerate(INFLUX_LINES):
        write_seed(influx, "line-%02d" % i, prec + text.encode())
        write_seed(influx, "small-%02d" % i, small_limit(prec) + text.encode())
    if args.corpus:
        for name, data in corpus_seeds(args.corpus):
            write_seed(influx, name, data)
            write_seed(accept, name, data)
            n_corpus += 1
    # The most tags and fields a point holds (tags unsorted), in few bytes so that mutations
    # can still add one under libFuzzer's default length limit (4 KiB). The repeated last field
    # is valid, and one changed byte makes it the 257th.
    tags = ",".join(short_key((i * 37) % 256) + "=v" for i in range(256))
    fields = ",".join(short_key(i) + "=1" for i in range(256)) + ",pp=2"
    write_seed(influx, "line-wide", b"0m," + tags.encode() + b" " + fields.encode() + b" 1")

    for i, (prec, text) in enumerate(GRAPHITE_LINES):
        write_seed(graphite, "line-%02d" % i, prec + text.encode())
        write_seed(graphite, "small-%02d" % i, small_limit(prec) + text.encode())
    wide = ";".join(short_key((i * 37) % 256) + "=v" for i in range(256))
    write_seed(graphite, "line-wide", b"0a.b;" + wide.encode() + b" 1 1600000000.5")

    # fuzz_accept: every hand-written line of both formats, flushed once and after every line
    # (Graphite's first byte has bit 3 set), then the batches made for it.
    n_accept = n_corpus
    for fmt, lines in ((0, INFLUX_LINES), (8, GRAPHITE_LINES)):
        for i, (prec, text) in enumerate(lines):
            for flush in (0, 0x40):
                name = "%s-%02d%s" % ("graphite" if fmt else "influx", i, "-each" if flush else "")
                write_seed(accept, name, bytes([prec[0] | fmt | flush]) + text.encode())
                n_accept += 1
    for name, data in accept_seeds():
        write_seed(accept, name, data)
        n_accept += 1

    write_dict(os.path.join(args.out, "influx.dict"), INFLUX_DICT)
    write_dict(os.path.join(args.out, "graphite.dict"), GRAPHITE_DICT)
    write_dict(os.path.join(args.out, "accept.dict"), ACCEPT_DICT)
    print("make_seeds: influx %d seeds (%d from the conformance corpus), graphite %d seeds, "
          "accept %d seeds"
          % (2 * len(INFLUX_LINES) + 1 + n_corpus, n_corpus, 2 * len(GRAPHITE_LINES) + 1,
             n_accept))


if __name__ == "__main__":
    main()
