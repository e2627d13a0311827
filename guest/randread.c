/*
 * randread DEVICE COUNT [SEED]
 *
 * Random 4 KiB reads from inside the guest: COUNT preads of 4 KiB at
 * 4 KiB-aligned offsets spread uniformly over DEVICE (a block device or a
 * file), opened with O_DIRECT so every read goes to the virtual disk and
 * never to the page cache. Offsets come from a fixed xorshift generator
 * seeded with SEED (default 1), so two runs with the same seed read the
 * same blocks in the same order. Prints
 *   reads=<n> total_ms=<float> iops=<float> p50_us=<float> p99_us=<float> sum=<hex>
 * where sum is a checksum of every byte read (the same blocks give the same
 * sum, so a run before and after a change of the disk's chain can be
 * compared). Each read is timed with CLOCK_MONOTONIC.
 *
 * Built static (gcc -static -O2) by guest/build.sh into the initramfs as
 * /bin/randread. Exit status: 0, or 1 on bad arguments or an I/O error.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define BLOCK 4096

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: randread DEVICE COUNT [SEED]\n");
        return 1;
    }
    long count = strtol(argv[2], NULL, 10);
    uint64_t x = argc > 3 ? strtoull(argv[3], NULL, 10) : 1;
    if (count <= 0 || x == 0) {
        fprintf(stderr, "randread: COUNT and SEED must be positive\n");
        return 1;
    }
    int fd = open(argv[1], O_RDONLY | O_DIRECT);
    if (fd < 0) {
        perror(argv[1]);
        return 1;
    }
    off_t size = lseek(fd, 0, SEEK_END);
    if (size < BLOCK) {
        fprintf(stderr, "randread: %s is smaller than one block\n", argv[1]);
        return 1;
    }
    uint64_t blocks = (uint64_t)size / BLOCK;
    void *buf;
    if (posix_memalign(&buf, BLOCK, BLOCK) != 0) {
        fprintf(stderr, "randread: out of memory\n");
        return 1;
    }
    double *lat = malloc(sizeof(double) * count);
    if (!lat) {
        fprintf(stderr, "randread: out of memory\n");
        return 1;
    }
    uint64_t sum = 0;
    double start = now_us();
    for (long i = 0; i < count; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        off_t off = (off_t)(x % blocks) * BLOCK;
        double t0 = now_us();
        ssize_t n = pread(fd, buf, BLOCK, off);
        lat[i] = now_us() - t0;
        if (n != BLOCK) {
            perror("pread");
            return 1;
        }
        const uint64_t *w = buf;
        for (int j = 0; j < BLOCK / 8; j++)
            sum = (sum ^ w[j]) * 0x100000001b3ULL;
    }
    double total = now_us() - start;
    qsort(lat, count, sizeof(double), cmp);
    printf("reads=%ld total_ms=%.3f iops=%.1f p50_us=%.1f p99_us=%.1f sum=%016llx\n", count,
           total / 1e3, count / (total / 1e6), lat[count / 2], lat[(count * 99) / 100],
           (unsigned long long)sum);
    return 0;
}
