#!/usr/bin/python3
"""Builds one man page from its scdoc source (tools/man/NAME.SECTION.scd).

  build-man.py SOURCE VERSION OUTPUT    writes OUTPUT (roff) and OUTPUT.gz (gzip -9n)
  build-man.py --scd SOURCE VERSION     prints the scdoc text after substitution

One substitution before scdoc(1) sees the source: @VERSION@, the project's version
(CMakeLists.txt). Each page's source is the one place its text lives: the configuration keys
in bucketd.yaml.5.scd, the counters and metrics in bucketd-metrics.7.scd, the documents and the
delivery guarantees in bucketd-schema.7.scd; README.md links to them.
tests/e2e/test_man_pages.py checks the pages against each program's --help, the configuration
schema (src/config_schema.c), the counters (include/bucketd/stats.h) and a real scrape.
"""

import gzip
import os
import subprocess
import sys


def scd_text(source, version):
    with open(source, encoding="utf-8") as f:
        return f.read().replace("@VERSION@", version)


def main(argv):
    if len(argv) == 4 and argv[1] == "--scd":
        sys.stdout.write(scd_text(argv[2], argv[3]))
        return 0
    if len(argv) != 4:
        sys.stderr.write(__doc__)
        return 2
    source, version, output = argv[1:]
    scdoc = os.environ.get("SCDOC", "scdoc")
    roff = subprocess.run([scdoc], input=scd_text(source, version).encode(),
                          stdout=subprocess.PIPE, check=True).stdout
    with open(output, "wb") as f:
        f.write(roff)
    # gzip -9n: no name or time stamp in the header, so the same page compresses to the same
    # bytes (Debian policy for man pages; lintian checks it).
    with open(output + ".gz", "wb") as raw:
        with gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=9, mtime=0) as gz:
            gz.write(roff)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
