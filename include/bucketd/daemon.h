/*
 * The daemon's lifecycle: wires the sensor table, the flusher thread and the ingest loop
 * together, runs until SIGTERM/SIGINT, then stops in order (listeners, rings, final flush).
 * Runs on the main thread, which becomes the ingest thread.
 */
#ifndef BUCKETD_DAEMON_H
#define BUCKETD_DAEMON_H

#include "bucketd/config.h"

/* Returns the process exit code: 0 after a clean stop, 1 if start-up failed. */
int bd_daemon_run(const struct bd_config *cfg);

#endif
