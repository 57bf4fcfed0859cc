/*
 * Unplaced spool records (src/unplaced.c): a batch's deltas encoded with their readings and
 * loaded back over detached sensors, building the very updates the originals build.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdalign.h>
#include <stdlib.h>
#include <string.h>

#include "bucketd/alloc.h"
#include "bucketd/bucket.h"
#include "bucketd/parse.h"
#include "bucketd/unplaced.h"

#define HOUR_MS INT64_C(3600000)
#define MS INT64_C(1000000)
#define H0 INT64_C(1736949600000) /* 2025-01-15T14:00:00Z */

#define STR(s) ((struct bd_str){s, sizeof(s) - 1})

static struct bd_sensor *a, *b;
static struct bd_sensor_names a_names, b_names;
static const struct bd_pages_limits lim = {.span_ms = HOUR_MS,
                                           .max_late_ms = 7 * 24 * HOUR_MS,
                                           .max_future_ms = HOUR_MS,
                                           .max_readings = 1000,
                                           .max_bytes = BD_PAGE_MAX_BYTES};

static void setup(void) {
    struct bd_str keys[] = {STR("loc"), STR("room")}, values[] = {STR("$home"), STR("kitchen")};
    cr_assert_eq(bd_sensor_detached_new(&a, &STR("weather,loc=$home,room=kitchen"), &STR("weather"),
                                        keys, values, 2),
                 0);
    memset(&a_names, 0, sizeof(a_names));
    a_names.name[0] = "temp";
    a_names.name[1] = "n";
    a_names.name[2] = "on";
    a_names.name[3] = "big";
    a->names = &a_names;
    atomic_init(&a->n_fields, 4);
    cr_assert_eq(bd_sensor_detached_new(&b, &STR("power"), &STR("power"), NULL, NULL, 0), 0);
    memset(&b_names, 0, sizeof(b_names));
    b_names.name[0] = "w";
    b->names = &b_names;
    atomic_init(&b->n_fields, 1);
}

static void teardown(void) {
    free(a);
    free(b);
}

TestSuite(unplaced, .init = setup, .fini = teardown);

/* Reading k of a: every kind of value. */
static void add_a(struct bd_delta *d, int64_t ts_ns, int k) {
    struct bd_reading_value v[4] = {
        {.field = 0, .kind = BD_VAL_FLOAT, .v.f = 20.5 + k},
        {.field = 1, .kind = BD_VAL_INT, .v.i = -k},
        {.field = 2, .kind = BD_VAL_BOOL, .v.b = k % 2},
        {.field = 3, .kind = BD_VAL_UINT, .v.u = UINT64_MAX - (uint64_t)k},
    };
    cr_assert_eq(bd_delta_add(d, ts_ns, v, k % 3 == 0 ? 4 : 2), 0);
}

static void add_b(struct bd_delta *d, int64_t ts_ns, double w) {
    struct bd_reading_value v = {.field = 0, .kind = BD_VAL_FLOAT, .v.f = w};
    cr_assert_eq(bd_delta_add(d, ts_ns, &v, 1), 0);
}

/* The update a delta builds, as bytes, for comparison. */
static void built(struct bd_delta *d, uint64_t seq, bson_t *sel, bson_t *upd) {
    cr_assert_eq(bd_delta_build_update(d, HOUR_MS, "w.gw", seq, sel, upd), 0);
}

static void assert_same_update(struct bd_delta *x, struct bd_delta *y) {
    bson_t s1, u1, s2, u2;
    built(x, 7, &s1, &u1);
    built(y, 7, &s2, &u2);
    cr_assert(bson_equal(&s1, &s2), "selectors differ");
    cr_assert(bson_equal(&u1, &u2), "updates differ");
    bson_destroy(&s1);
    bson_destroy(&u1);
    bson_destroy(&s2);
    bson_destroy(&u2);
}

struct fixture {
    struct bd_delta d[3];
    struct bd_replay_buf buf;
};

static void encode_three(struct fixture *fx) {
    memset(fx, 0, sizeof(*fx));
    bd_delta_init(&fx->d[0], a, H0, BD_PAGE_UNKNOWN);
    bd_delta_init(&fx->d[1], a, H0 + HOUR_MS, 3);
    bd_delta_init(&fx->d[2], b, H0, 0);
    for (int k = 0; k < 10; k++) {
        add_a(&fx->d[0], (H0 + 1000 * k) * MS, k);
        add_a(&fx->d[1], (H0 + HOUR_MS + 500 * (10 - k)) * MS, k); /* out of order */
    }
    add_b(&fx->d[2], (H0 + 5) * MS, -1.5);
    add_b(&fx->d[2], (H0 + 5) * MS, 2.5); /* equal timestamps keep arrival order */
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(bd_unplaced_add(&fx->buf, &fx->d[i]), 0);
    }
    cr_assert_eq(fx->buf.n_readings, 22);
    cr_assert_eq(fx->buf.n_updates, 3);
}

static void close_three(struct fixture *fx) {
    for (int i = 0; i < 3; i++) {
        bd_delta_close(&fx->d[i]);
    }
    bd_replay_buf_close(&fx->buf);
}

static int64_t find(struct bd_batch *bt, const char *id, int64_t start, uint32_t page) {
    for (uint32_t i = 0; i < bt->n; i++) {
        if (strcmp(bt->deltas[i].sensor->id_buf, id) == 0 && bt->deltas[i].start_ms == start &&
            bt->deltas[i].page == page) {
            return i;
        }
    }
    return -1;
}

Test(unplaced, round_trip_builds_the_same_updates) {
    struct fixture fx;
    encode_three(&fx);
    struct bd_unplaced *u;
    struct bd_err err = {0};
    cr_assert_eq(bd_unplaced_load(&u, fx.buf.data, fx.buf.len, &lim, &err), 0, "%s", err.msg);
    cr_assert_eq(bd_unplaced_readings(u), 22);
    cr_assert_eq(bd_unplaced_sensors(u), 2, "one detached sensor per distinct id");
    struct bd_batch *bt = bd_unplaced_batch(u);
    cr_assert_eq(bt->n, 3);
    for (int i = 0; i < 3; i++) {
        int64_t j = find(bt, bd_sensor_id(fx.d[i].sensor), fx.d[i].start_ms, fx.d[i].page);
        cr_assert_geq(j, 0, "delta %d not loaded", i);
        struct bd_delta *l = &bt->deltas[j];
        cr_assert_eq(l->n_readings, fx.d[i].n_readings);
        cr_assert_neq(l->sensor, fx.d[i].sensor, "a detached sensor, not the original");
        cr_assert_str_eq(bd_sensor_measurement(l->sensor), bd_sensor_measurement(fx.d[i].sensor));
        cr_assert_eq(l->sensor->n_tags, fx.d[i].sensor->n_tags);
        if (fx.d[i].page != BD_PAGE_UNKNOWN) {
            assert_same_update(&fx.d[i], l);
        } else {
            /* Built at a page once placed: the same update as the original at that page. */
            fx.d[i].page = 2;
            l->page = 2;
            assert_same_update(&fx.d[i], l);
            fx.d[i].page = BD_PAGE_UNKNOWN;
            l->page = BD_PAGE_UNKNOWN;
        }
    }
    /* Page slots: unknown where the page was, known at the page otherwise. */
    struct bd_sensor *da = bt->deltas[find(bt, bd_sensor_id(a), H0, BD_PAGE_UNKNOWN)].sensor;
    struct bd_page_slot *s0 = bd_pages_find(da->flusher_state, &lim, H0);
    struct bd_page_slot *s1 = bd_pages_find(da->flusher_state, &lim, H0 + HOUR_MS);
    cr_assert(s0 != NULL && !s0->known);
    cr_assert(s1 != NULL && s1->known);
    cr_assert_eq(s1->page, 3);
    bd_unplaced_free(u);
    close_three(&fx);
}

Test(unplaced, entries_of_one_page_merge) {
    struct bd_delta d1, d2;
    struct bd_replay_buf buf = {0};
    bd_delta_init(&d1, b, H0, 4);
    bd_delta_init(&d2, b, H0, 4);
    add_b(&d1, (H0 + 1) * MS, 1.0);
    add_b(&d2, (H0 + 2) * MS, 2.0);
    add_b(&d2, (H0 + 3) * MS, 3.0);
    cr_assert_eq(bd_unplaced_add(&buf, &d1), 0);
    cr_assert_eq(bd_unplaced_add(&buf, &d2), 0);
    struct bd_unplaced *u;
    struct bd_err err = {0};
    cr_assert_eq(bd_unplaced_load(&u, buf.data, buf.len, &lim, &err), 0, "%s", err.msg);
    struct bd_batch *bt = bd_unplaced_batch(u);
    cr_assert_eq(bt->n, 1, "two entries of one page are one delta");
    cr_assert_eq(bt->deltas[0].n_readings, 3);
    cr_assert_eq(bd_pages_find(bt->deltas[0].sensor->flusher_state, &lim, H0)->count, 3);
    bd_unplaced_free(u);
    bd_delta_close(&d1);
    bd_delta_close(&d2);
    bd_replay_buf_close(&buf);
}

Test(unplaced, every_truncation_and_damage_is_refused) {
    struct fixture fx;
    encode_three(&fx);
    /* Entry boundaries: a payload cut there is a shorter valid record (the spool's checksum
     * covers the whole payload); anywhere else must not parse. */
    size_t bounds[4] = {0};
    for (int i = 0, at = 0; i < 3; i++) {
        at += (int)bd_get_le32(fx.buf.data + at);
        bounds[i + 1] = (size_t)at;
    }
    cr_assert_eq(bounds[3], fx.buf.len);
    struct bd_err err = {0};
    for (size_t cut = 1; cut < fx.buf.len; cut++) {
        struct bd_unplaced *u = NULL;
        int rc = bd_unplaced_load(&u, fx.buf.data, cut, &lim, &err);
        bool boundary = cut == bounds[1] || cut == bounds[2];
        cr_assert_eq(rc, boundary ? 0 : -EBADMSG, "cut at %zu: %d", cut, rc);
        bd_unplaced_free(u);
    }
    /* A value naming a field the entry has no name for. */
    uint8_t *copy = malloc(fx.buf.len);
    memcpy(copy, fx.buf.data, fx.buf.len);
    size_t last = bounds[2]; /* b's entry: header, "power" twice, one name, 2 readings */
    size_t first_value = last + 40 + 5 + 5 + 4 + 1 + 12;
    copy[first_value] = 9;
    struct bd_unplaced *u = NULL;
    cr_assert_eq(bd_unplaced_load(&u, copy, fx.buf.len, &lim, &err), -EBADMSG);
    cr_assert(strstr(err.msg, "does not parse") != NULL, "%s", err.msg);
    /* A reading outside its entry's bucket. */
    memcpy(copy, fx.buf.data, fx.buf.len);
    bd_put_le64(copy + first_value - 12, (uint64_t)((H0 + HOUR_MS) * MS));
    cr_assert_eq(bd_unplaced_load(&u, copy, fx.buf.len, &lim, &err), -EBADMSG);
    /* An entry length past the end. */
    memcpy(copy, fx.buf.data, fx.buf.len);
    bd_put_le32(copy + last, (uint32_t)(fx.buf.len - last + 1));
    cr_assert_eq(bd_unplaced_load(&u, copy, fx.buf.len, &lim, &err), -EBADMSG);
    free(copy);
    close_three(&fx);
}

Test(unplaced, allocation_failures_leave_nothing_behind) {
    struct fixture fx;
    encode_three(&fx);
    struct bd_err err = {0};
    int ok = 0;
    for (long n = 0; n < 200 && ok == 0; n++) {
        struct bd_unplaced *u = NULL;
        bd_alloc_fail_after(n, 1);
        int rc = bd_unplaced_load(&u, fx.buf.data, fx.buf.len, &lim, &err);
        bd_alloc_fail_after(-1, 0);
        cr_assert(rc == 0 || rc == -ENOMEM, "allocation %ld failing: %d", n, rc);
        if (rc == 0) {
            cr_assert_eq(bd_unplaced_readings(u), 22);
            ok = 1;
        } else {
            cr_assert_null(u);
        }
        bd_unplaced_free(u);
    }
    cr_assert(ok, "never loaded with 200 allocations allowed");
    /* Encoding: -ENOMEM leaves the buffer as it was. */
    struct bd_replay_buf buf = {0};
    bd_alloc_fail_after(0, 1);
    cr_assert_eq(bd_unplaced_add(&buf, &fx.d[0]), -ENOMEM);
    bd_alloc_fail_after(-1, 0);
    cr_assert_eq(buf.len, 0);
    cr_assert_eq(buf.n_readings, 0);
    close_three(&fx);
}
