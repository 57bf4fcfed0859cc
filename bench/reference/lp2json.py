# bench_parse's influx buffer as NDJSON, one object per line with the same name, tags, fields and time.
import sys, json
out = open(sys.argv[2], 'w')
for line in open(sys.argv[1]):
    line = line.rstrip('\n')
    head, fields, ts = line.split(' ')
    parts = head.split(',')
    tags = dict(p.split('=', 1) for p in parts[1:])
    fd = {}
    for f in fields.split(','):
        k, v = f.split('=', 1)
        fd[k] = int(v[:-1]) if v.endswith('i') else float(v)
    out.write(json.dumps({"name": parts[0], "tags": tags, "fields": fd, "time": int(ts)}, separators=(',', ':')) + '\n')
