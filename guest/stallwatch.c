/*
 * stallwatch FILE SECONDS [INTERVAL_US]
 * stallwatch -t
 *
 * Measures, from inside the guest, how long writes to a filesystem were
 * blocked: appends small records to FILE with plain write(2) for SECONDS
 * seconds, sleeping INTERVAL_US microseconds (default 1000) between writes so
 * the single vCPU is not saturated, and tracks the largest gap between two
 * consecutive completed writes (CLOCK_MONOTONIC). A write(2) to a frozen
 * filesystem blocks until it is thawed, so during a snapshot the largest gap
 * is the freeze window as an application in the guest sees it.
 *
 * At the end it prints
 *   max_stall_ms=<float> writes=<n>
 * and, for diagnosis, a line with the run's bounds and the median gap (the
 * normal pace), and one with the longest gaps, longest first, each as
 * <start>:<length>, all times in ms of CLOCK_MONOTONIC:
 *   start_ms=<float> end_ms=<float> median_gap_ms=<float>
 *   top_gaps=<start>:<len>,<start>:<len>,...
 * so a caller can tell which stall overlapped a snapshot.
 *
 * `stallwatch -t` prints CLOCK_MONOTONIC in ms (`now_ms=<float>`), so the
 * host can relate guest and host times.
 *
 * Built static (gcc -static -O2) by guest/build.sh into the initramfs as
 * /bin/stallwatch. Exit status: 0, or 1 on bad arguments or an I/O error.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* Histogram of gaps in 10 us buckets up to 100 ms (for the median gap). */
#define BUCKET_US 10
#define BUCKETS 10000

static unsigned long hist[BUCKETS + 1];

/* The TOP longest gaps, longest first. */
#define TOP 32
struct gap {
    double start, len;
};
static struct gap top[TOP];
static int ntop;

static void keep_gap(double start, double len)
{
    if (ntop == TOP && len <= top[TOP - 1].len)
        return;
    int i = ntop < TOP ? ntop++ : TOP - 1;
    while (i > 0 && top[i - 1].len < len) {
        top[i] = top[i - 1];
        i--;
    }
    top[i].start = start;
    top[i].len = len;
}

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static int write_all(int fd, const char *buf, size_t len)
{
    while (len > 0) {
        ssize_t n = write(fd, buf, len);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        buf += n;
        len -= (size_t)n;
    }
    return 0;
}

static int parse_num(const char *s, double *out)
{
    char *end;
    errno = 0;
    *out = strtod(s, &end);
    return errno == 0 && end != s && *end == '\0' && *out >= 0;
}

int main(int argc, char **argv)
{
    double seconds, interval_us = 1000;
    if (argc == 2 && strcmp(argv[1], "-t") == 0) {
        printf("now_ms=%.3f\n", now_ms());
        return 0;
    }
    if (argc < 3 || argc > 4 || !parse_num(argv[2], &seconds) ||
        (argc == 4 && !parse_num(argv[3], &interval_us))) {
        fprintf(stderr, "usage: %s FILE SECONDS [INTERVAL_US] | %s -t\n", argv[0], argv[0]);
        return 1;
    }

    int fd = open(argv[1], O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd < 0) {
        fprintf(stderr, "stallwatch: open %s: %s\n", argv[1], strerror(errno));
        return 1;
    }

    struct timespec pause = {
        .tv_sec = (time_t)(interval_us / 1e6),
        .tv_nsec = (long)((interval_us - (double)(time_t)(interval_us / 1e6) * 1e6) * 1e3),
    };
    double start = now_ms(), end = start + seconds * 1e3;
    double prev = start;
    unsigned long writes = 0;
    char rec[64];

    for (;;) {
        double t = now_ms();
        int len = snprintf(rec, sizeof rec, "%lu %.3f\n", writes, t - start);
        if (write_all(fd, rec, (size_t)len) < 0) {
            fprintf(stderr, "stallwatch: write %s: %s\n", argv[1], strerror(errno));
            return 1;
        }
        double done = now_ms();
        if (writes > 0) {
            double gap = done - prev;
            keep_gap(prev, gap);
            long b = (long)(gap * 1e3 / BUCKET_US);
            hist[b < BUCKETS ? b : BUCKETS]++;
        }
        prev = done;
        writes++;
        if (done >= end)
            break;
        if (interval_us > 0)
            nanosleep(&pause, NULL);
    }
    close(fd);

    /* Median gap from the histogram (bucket midpoint). */
    double median = 0;
    unsigned long gaps = writes > 0 ? writes - 1 : 0, seen = 0;
    for (long b = 0; b <= BUCKETS && gaps > 0; b++) {
        seen += hist[b];
        if (seen * 2 >= gaps) {
            median = ((double)b + 0.5) * BUCKET_US / 1e3;
            break;
        }
    }

    printf("max_stall_ms=%.3f writes=%lu\n", ntop > 0 ? top[0].len : 0.0, writes);
    printf("start_ms=%.3f end_ms=%.3f median_gap_ms=%.3f\n", start, prev, median);
    printf("top_gaps=");
    for (int i = 0; i < ntop; i++)
        printf("%s%.3f:%.3f", i ? "," : "", top[i].start, top[i].len);
    printf("\n");
    return 0;
}
