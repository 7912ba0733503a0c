/*
 * loadgen: a small epoll load generator for beanstalkd-protocol servers.
 *
 * One thread, N non-blocking connections, up to D commands outstanding per
 * connection (pipeline depth).  Workloads:
 *   put    - "put" forever (or -n puts) into one tube
 *   cycle  - put, reserve, delete (the delete is sent once the RESERVED id is known)
 *   drain  - reserve-with-timeout 0 + delete until the pre-filled tube is empty
 *            (-n JOBS: send at most JOBS reserves, stop once they are answered
 *            and their jobs deleted)
 * Every command counts as one op.  Latency = time from writing a command to
 * reading its reply (log-linear histogram, <1.6% bucket error).
 *
 * Bounded: ends after -t seconds (after -W warm-up seconds that are not
 * measured) or after -n ops/jobs; never waits more than -G seconds for the
 * replies still outstanding at the end.  Loopback/any host, no retries.
 *
 * If -P PID is given, reads /proc/PID/stat (utime+stime) at the start and the
 * end of the measured window and reports server CPU microseconds per op.
 * Its own CPU over the window (CLOCK_PROCESS_CPUTIME_ID) is always reported,
 * so you can see whether the generator itself is the bottleneck.
 *
 * -S (stepped, for bench/instructions.py): once every connection is set up,
 * print "loadgen: connected" on stderr and wait for a line on stdin; after the
 * last reply, print "loadgen: finished" and wait for another before closing.
 * A counter switched on and off at those two points sees the commands only,
 * not the connections' setup and teardown.
 *
 * Output: one line of JSON on stdout.
 *
 * Build: gcc -O2 -Wall -o bench/bin/loadgen bench/loadgen.c
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

enum { W_PUT, W_CYCLE, W_DRAIN };
enum { K_PUT = 1, K_RES, K_DEL };

typedef struct {
    int fd;
    int alive;
    char *rbuf;
    size_t rlen, rcap;
    char *wbuf;
    size_t wlen, woff, wcap;
    uint64_t *ts;      /* ring of send times of outstanding commands */
    uint8_t *kind;     /* ring of kinds */
    int head, count, cap;
    uint64_t *dels;    /* ids waiting to be deleted */
    int ndel, capdel;
    int owe_reserve;   /* cycle: a put was sent, its reserve not yet */
    int done;          /* drain: got TIMED_OUT, send no more reserves */
    int want_out;
    int unsent;        /* commands queued in wbuf since the last send */
} conn_t;

/* ---------- options ---------- */
static const char *opt_host = "127.0.0.1";
static const char *opt_port = "11300";
static int opt_conns = 1, opt_depth = 1, opt_workload = W_PUT, opt_body = 100;
static double opt_time = 5.0, opt_warm = 0.5, opt_grace = 5.0;
static long long opt_n = 0; /* 0: run by time */
static const char *opt_tube = "bench";
static int opt_pid = 0;
static int opt_step = 0;
static int opt_pri = 1024, opt_ttr = 120;

/* ---------- state ---------- */
static conn_t *conns;
static int epfd;
static char *putcmd;
static size_t putlen;
static int measuring, stopping;
static long long issued_units; /* puts (put), cycles started (cycle) */
static long long ops_total, ops_win, jobs_win, jobs_total;
static long long err_count, timed_out, conn_errors, deadline_soon;
static char first_err[128];
static uint64_t t_win_start, t_win_end, t_last_reply;

/* ---------- I/O shape (measured window only) ----------
 * How the byte stream is cut: replies per recv() and commands per send(), as log2 buckets
 * 0, 1, 2, 3-4, 5-8, ..., 129-256, 257+ (a recv holding no complete reply counts as 0).
 * Both servers are judged by the same counters: a server answering a packet of N commands
 * with one write shows up as N replies per read here. */
#define IOB 11
static long long rd_calls, rd_bytes, rd_replies, wr_calls, wr_cmds, wakeups;
static long long rd_hist[IOB], wr_hist[IOB];
static inline int io_bucket(long long n) {
    if (n <= 0) return 0;
    int b = 1;
    long long lim = 1;
    while (n > lim && b < IOB - 1) { lim <<= 1; b++; }
    return b;
}

/* ---------- histogram ---------- */
#define SUBB 6
#define SUB (1 << SUBB)
#define NBUCK (2 * SUB + 60 * SUB)
static uint64_t hist[NBUCK];
static uint64_t lat_max, lat_sum, lat_n;

static inline int bucket_of(uint64_t v) {
    if (v < 2 * SUB) return (int)v;
    int msb = 63 - __builtin_clzll(v);
    int shift = msb - SUBB;
    return 2 * SUB + (shift - 1) * SUB + (int)((v >> shift) - SUB);
}
static inline uint64_t value_of(int i) {
    if (i < 2 * SUB) return (uint64_t)i;
    int shift = (i - 2 * SUB) / SUB + 1;
    uint64_t m = (uint64_t)((i - 2 * SUB) % SUB + SUB);
    return (m << shift) + ((1ULL << shift) >> 1);
}
static double percentile_us(double p) {
    if (lat_n == 0) return 0.0;
    uint64_t want = (uint64_t)(p * (double)lat_n);
    if (want >= lat_n) want = lat_n - 1;
    uint64_t acc = 0;
    for (int i = 0; i < NBUCK; i++) {
        acc += hist[i];
        if (acc > want) return value_of(i) / 1000.0;
    }
    return lat_max / 1000.0;
}

static inline uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}
static uint64_t cpu_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}
/* server utime+stime in clock ticks, or -1; *user gets utime alone */
static long long proc_cpu_ticks2(int pid, long long *user) {
    if (pid <= 0) return -1;
    char path[64], buf[2048];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    int fd = open(path, O_RDONLY);
    if (fd < 0) return -1;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return -1;
    buf[n] = 0;
    char *p = strrchr(buf, ')');
    if (!p) return -1;
    p += 2; /* field 3 (state) */
    unsigned long long ut = 0, st = 0;
    /* fields 3..15: state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime */
    if (sscanf(p, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &ut, &st) != 2) return -1;
    if (user) *user = (long long)ut;
    return (long long)(ut + st);
}
static long long srv_user0, srv_user1;
static int srv_sample;
static long long proc_cpu_ticks(int pid) {
    return proc_cpu_ticks2(pid, srv_sample++ == 0 ? &srv_user0 : &srv_user1);
}

static void die(const char *msg) {
    fprintf(stderr, "loadgen: %s: %s\n", msg, strerror(errno));
    exit(2);
}

static void *xrealloc(void *p, size_t n) {
    void *q = realloc(p, n);
    if (!q) { fprintf(stderr, "loadgen: out of memory\n"); exit(2); }
    return q;
}

/* ---------- output buffer ---------- */
static inline void wput(conn_t *c, const char *s, size_t n) {
    if (c->wlen + n > c->wcap) {
        if (c->woff) { /* compact */
            memmove(c->wbuf, c->wbuf + c->woff, c->wlen - c->woff);
            c->wlen -= c->woff;
            c->woff = 0;
        }
        while (c->wlen + n > c->wcap) c->wcap *= 2;
        c->wbuf = xrealloc(c->wbuf, c->wcap);
    }
    memcpy(c->wbuf + c->wlen, s, n);
    c->wlen += n;
}

static inline void push_cmd(conn_t *c, int kind, uint64_t t) {
    if (c->count == c->cap) { fprintf(stderr, "loadgen: ring overflow\n"); exit(2); }
    int i = (c->head + c->count) % c->cap;
    c->ts[i] = t;
    c->kind[i] = (uint8_t)kind;
    c->count++;
    c->unsent++;
}

static void conn_fail(conn_t *c, const char *why) {
    if (!c->alive) return;
    conn_errors++;
    if (!first_err[0]) snprintf(first_err, sizeof first_err, "connection: %s", why);
    epoll_ctl(epfd, EPOLL_CTL_DEL, c->fd, NULL);
    close(c->fd);
    c->alive = 0;
    c->count = 0;
}

static void set_out(conn_t *c, int on) {
    if (c->want_out == on) return;
    struct epoll_event ev = {.events = EPOLLIN | (on ? EPOLLOUT : 0), .data.ptr = c};
    epoll_ctl(epfd, EPOLL_CTL_MOD, c->fd, &ev);
    c->want_out = on;
}

static void flush(conn_t *c) {
    while (c->alive && c->woff < c->wlen) {
        ssize_t n = send(c->fd, c->wbuf + c->woff, c->wlen - c->woff, MSG_NOSIGNAL);
        if (n > 0) {
            c->woff += (size_t)n;
            if (measuring) {
                wr_calls++;
                wr_cmds += c->unsent;
                wr_hist[io_bucket(c->unsent)]++;
            }
            c->unsent = 0;
        } else if (n < 0 && errno == EINTR) {
            continue;
        } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            set_out(c, 1);
            return;
        } else {
            conn_fail(c, strerror(errno));
            return;
        }
    }
    c->woff = c->wlen = 0;
    set_out(c, 0);
}

/* issue commands until the window is full */
static void refill(conn_t *c, uint64_t t) {
    char tmp[64];
    if (!c->alive) return;
    while (c->count < opt_depth) {
        if (c->ndel > 0) { /* deletes first: they free jobs */
            uint64_t id = c->dels[--c->ndel];
            int n = snprintf(tmp, sizeof tmp, "delete %llu\r\n", (unsigned long long)id);
            wput(c, tmp, (size_t)n);
            push_cmd(c, K_DEL, t);
            continue;
        }
        if (stopping) break;
        if (opt_workload == W_PUT) {
            if (opt_n && issued_units >= opt_n) break;
            wput(c, putcmd, putlen);
            push_cmd(c, K_PUT, t);
            issued_units++;
        } else if (opt_workload == W_CYCLE) {
            if (c->owe_reserve) {
                wput(c, "reserve\r\n", 9);
                push_cmd(c, K_RES, t);
                c->owe_reserve = 0;
            } else {
                if (opt_n && issued_units >= opt_n) break;
                wput(c, putcmd, putlen);
                push_cmd(c, K_PUT, t);
                c->owe_reserve = 1;
                issued_units++;
            }
        } else { /* drain: at most -n reserves in all, so a full tube gives no TIMED_OUT tail */
            if (c->done) break;
            if (opt_n && issued_units >= opt_n) break;
            issued_units++;
            wput(c, "reserve-with-timeout 0\r\n", 24);
            push_cmd(c, K_RES, t);
        }
    }
}

static void note_err(const char *line, size_t len) {
    err_count++;
    if (!first_err[0]) {
        size_t k = 0;
        for (size_t i = 0; i < len && k < sizeof first_err - 1; i++)
            first_err[k++] = (line[i] >= 32 && line[i] < 127 && line[i] != '"' && line[i] != '\\') ? line[i] : '?';
        first_err[k] = 0;
    }
}

/* parse complete replies in c->rbuf; returns 0 ok, -1 protocol confusion */
static int parse(conn_t *c, uint64_t t) {
    size_t pos = 0;
    while (pos < c->rlen) {
        char *start = c->rbuf + pos;
        char *eol = memmem(start, c->rlen - pos, "\r\n", 2);
        if (!eol) break;
        size_t llen = (size_t)(eol - start);
        size_t consumed = llen + 2;
        if (c->count == 0) { note_err(start, llen); return -1; }
        int kind = c->kind[c->head];
        uint64_t sent = c->ts[c->head];
        int job_done = 0;
        if (llen > 9 && memcmp(start, "RESERVED ", 9) == 0) {
            unsigned long long id = 0, bytes = 0;
            char *p = start + 9;
            id = strtoull(p, &p, 10);
            bytes = strtoull(p, NULL, 10);
            if (c->rlen - pos < consumed + bytes + 2) break; /* body not complete yet */
            consumed += bytes + 2;
            if (kind != K_RES) note_err(start, llen);
            if (c->ndel == c->capdel) {
                c->capdel *= 2;
                c->dels = xrealloc(c->dels, sizeof(uint64_t) * (size_t)c->capdel);
            }
            c->dels[c->ndel++] = id;
        } else if (kind == K_PUT && llen > 9 && memcmp(start, "INSERTED ", 9) == 0) {
            if (opt_workload == W_PUT) job_done = 1;
        } else if (kind == K_DEL && llen == 7 && memcmp(start, "DELETED", 7) == 0) {
            job_done = 1;
        } else if (kind == K_RES && llen == 9 && memcmp(start, "TIMED_OUT", 9) == 0) {
            timed_out++;
            c->done = 1;
        } else if (kind == K_RES && llen == 13 && memcmp(start, "DEADLINE_SOON", 13) == 0) {
            deadline_soon++;
            if (opt_workload == W_CYCLE) c->owe_reserve = 1;
        } else {
            note_err(start, llen);
            if (kind == K_RES && opt_workload == W_DRAIN) c->done = 1;
        }
        c->head = (c->head + 1) % c->cap;
        c->count--;
        pos += consumed;
        ops_total++;
        if (job_done) jobs_total++;
        t_last_reply = t;
        if (measuring) {
            ops_win++;
            if (job_done) jobs_win++;
            uint64_t lat = t > sent ? t - sent : 0;
            hist[bucket_of(lat)]++;
            lat_sum += lat;
            lat_n++;
            if (lat > lat_max) lat_max = lat;
        }
    }
    if (pos) {
        memmove(c->rbuf, c->rbuf + pos, c->rlen - pos);
        c->rlen -= pos;
    }
    return 0;
}

static void on_readable(conn_t *c, uint64_t t) {
    for (;;) {
        if (c->rcap - c->rlen < 16384) {
            c->rcap *= 2;
            c->rbuf = xrealloc(c->rbuf, c->rcap);
        }
        ssize_t n = recv(c->fd, c->rbuf + c->rlen, c->rcap - c->rlen, 0);
        if (n > 0) {
            c->rlen += (size_t)n;
            long long before = ops_total;
            if (parse(c, t) < 0) { conn_fail(c, "unexpected reply"); return; }
            if (measuring) {
                rd_calls++;
                rd_bytes += n;
                rd_replies += ops_total - before;
                rd_hist[io_bucket(ops_total - before)]++;
            }
            if ((size_t)n < c->rcap - c->rlen) return; /* probably drained the socket */
            continue;
        }
        if (n == 0) { conn_fail(c, "server closed the connection"); return; }
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return;
        conn_fail(c, strerror(errno));
        return;
    }
}

/* blocking connect + setup commands; returns fd */
static int connect_one(struct addrinfo *ai, const char *setup, int nreplies) {
    int fd = socket(ai->ai_family, SOCK_STREAM, 0);
    if (fd < 0) die("socket");
    struct timeval tv = {.tv_sec = 10};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    if (connect(fd, ai->ai_addr, ai->ai_addrlen) < 0) die("connect");
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    size_t len = strlen(setup);
    if (len && send(fd, setup, len, MSG_NOSIGNAL) != (ssize_t)len) die("setup send");
    char buf[512];
    size_t have = 0;
    int lines = 0;
    while (lines < nreplies) {
        ssize_t n = recv(fd, buf + have, sizeof buf - 1 - have, 0);
        if (n <= 0) die("setup recv");
        have += (size_t)n;
        buf[have] = 0;
        lines = 0;
        for (char *p = buf; (p = strstr(p, "\r\n")); p += 2) lines++;
    }
    if (strstr(buf, "BAD_FORMAT") || strstr(buf, "UNKNOWN") || strstr(buf, "ERROR")) {
        fprintf(stderr, "loadgen: setup failed: %s\n", buf);
        exit(2);
    }
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    return fd;
}

/* -S: say where we are, then wait for the go-ahead (a line, or end of input) on stdin */
static void step(const char *where) {
    char line[64];
    fprintf(stderr, "loadgen: %s\n", where);
    fflush(stderr);
    if (!fgets(line, sizeof line, stdin)) return;
}

static void usage(void) {
    fprintf(stderr,
            "usage: loadgen [-h host] [-p port] [-w put|cycle|drain] [-c conns] [-d depth]\n"
            "               [-s body_bytes] [-t seconds] [-W warmup_s] [-n ops_or_jobs]\n"
            "               [-T tube] [-P server_pid] [-G grace_s] [-S]\n");
    exit(2);
}

int main(int argc, char **argv) {
    int ch;
    while ((ch = getopt(argc, argv, "h:p:w:c:d:s:t:W:n:T:P:G:S")) != -1) {
        switch (ch) {
        case 'h': opt_host = optarg; break;
        case 'p': opt_port = optarg; break;
        case 'w':
            if (!strcmp(optarg, "put")) opt_workload = W_PUT;
            else if (!strcmp(optarg, "cycle")) opt_workload = W_CYCLE;
            else if (!strcmp(optarg, "drain")) opt_workload = W_DRAIN;
            else usage();
            break;
        case 'c': opt_conns = atoi(optarg); break;
        case 'd': opt_depth = atoi(optarg); break;
        case 's': opt_body = atoi(optarg); break;
        case 't': opt_time = atof(optarg); break;
        case 'W': opt_warm = atof(optarg); break;
        case 'n': opt_n = atoll(optarg); break;
        case 'T': opt_tube = optarg; break;
        case 'P': opt_pid = atoi(optarg); break;
        case 'G': opt_grace = atof(optarg); break;
        case 'S': opt_step = 1; break;
        default: usage();
        }
    }
    if (opt_conns < 1 || opt_depth < 1 || opt_body < 0 || opt_time <= 0) usage();
    if (opt_workload == W_CYCLE && opt_depth < 2) opt_depth = opt_depth; /* depth 1: strictly sequential */
    signal(SIGPIPE, SIG_IGN);

    /* the put command, built once */
    char head[128];
    int hl = snprintf(head, sizeof head, "put %d 0 %d %d\r\n", opt_pri, opt_ttr, opt_body);
    putlen = (size_t)hl + (size_t)opt_body + 2;
    putcmd = malloc(putlen);
    memcpy(putcmd, head, (size_t)hl);
    for (int i = 0; i < opt_body; i++) putcmd[hl + i] = (char)('a' + i % 26);
    memcpy(putcmd + hl + opt_body, "\r\n", 2);

    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *ai;
    if (getaddrinfo(opt_host, opt_port, &hints, &ai) != 0) { fprintf(stderr, "loadgen: bad address\n"); return 2; }

    char setup[512];
    int nsetup;
    if (opt_workload == W_PUT) {
        snprintf(setup, sizeof setup, "use %s\r\n", opt_tube);
        nsetup = 1;
    } else if (opt_workload == W_CYCLE) {
        snprintf(setup, sizeof setup, "use %s\r\nwatch %s\r\nignore default\r\n", opt_tube, opt_tube);
        nsetup = 3;
    } else {
        snprintf(setup, sizeof setup, "watch %s\r\nignore default\r\n", opt_tube);
        nsetup = 2;
    }
    if (!strcmp(opt_tube, "default")) { /* nothing to ignore */
        if (opt_workload == W_CYCLE) { snprintf(setup, sizeof setup, "use default\r\n"); nsetup = 1; }
        if (opt_workload == W_DRAIN) { setup[0] = 0; nsetup = 0; }
    }

    epfd = epoll_create1(0);
    if (epfd < 0) die("epoll_create1");
    conns = calloc((size_t)opt_conns, sizeof(conn_t));
    for (int i = 0; i < opt_conns; i++) {
        conn_t *c = &conns[i];
        c->fd = connect_one(ai, setup, nsetup);
        c->alive = 1;
        c->rcap = 65536;
        c->rbuf = malloc(c->rcap);
        c->wcap = 65536;
        c->wbuf = malloc(c->wcap);
        c->cap = opt_depth + 2;
        c->ts = calloc((size_t)c->cap, sizeof(uint64_t));
        c->kind = calloc((size_t)c->cap, 1);
        c->capdel = opt_depth + 2;
        c->dels = calloc((size_t)c->capdel, sizeof(uint64_t));
        struct epoll_event ev = {.events = EPOLLIN, .data.ptr = c};
        if (epoll_ctl(epfd, EPOLL_CTL_ADD, c->fd, &ev) < 0) die("epoll_ctl");
    }
    freeaddrinfo(ai);
    if (opt_step) step("connected");

    int by_count = opt_n > 0 || opt_workload == W_DRAIN;
    uint64_t t0 = now_ns();
    uint64_t t_measure = by_count ? t0 : t0 + (uint64_t)(opt_warm * 1e9);
    uint64_t t_stop = by_count ? UINT64_MAX : t_measure + (uint64_t)(opt_time * 1e9);
    uint64_t t_grace_end = UINT64_MAX;
    long long srv0 = -1, srv1 = -1;
    uint64_t cpu0 = 0, cpu1 = 0;
    if (t_measure <= t0) {
        measuring = 1;
        t_win_start = t0;
        srv0 = proc_cpu_ticks(opt_pid);
        cpu0 = cpu_ns();
    }
    for (int i = 0; i < opt_conns; i++) {
        refill(&conns[i], t0);
        flush(&conns[i]);
    }

    struct epoll_event *evs = calloc((size_t)opt_conns, sizeof *evs);
    for (;;) {
        uint64_t t = now_ns();
        if (!measuring && !stopping && t >= t_measure) {
            measuring = 1;
            t_win_start = t;
            srv0 = proc_cpu_ticks(opt_pid);
            cpu0 = cpu_ns();
        }
        if (!stopping && t >= t_stop) {
            stopping = 1;
            measuring = 0;
            t_win_end = t;
            srv1 = proc_cpu_ticks(opt_pid);
            cpu1 = cpu_ns();
            t_grace_end = t + (uint64_t)(opt_grace * 1e9);
        }
        /* done? */
        int outstanding = 0, alive = 0, active = 0;
        for (int i = 0; i < opt_conns; i++) {
            conn_t *c = &conns[i];
            if (!c->alive) continue;
            alive++;
            outstanding += c->count;
            if (opt_workload == W_DRAIN ? !c->done : 1) active++;
        }
        if (!alive) break;
        if (by_count) {
            int finished = 0;
            if (opt_workload == W_DRAIN) {
                if (opt_n && (jobs_total >= opt_n || issued_units >= opt_n) && outstanding == 0) finished = 1;
                if (active == 0 && outstanding == 0) finished = 1;
            } else {
                if (issued_units >= opt_n && outstanding == 0) finished = 1;
            }
            if (opt_workload == W_DRAIN && opt_n && jobs_total >= opt_n && !stopping) {
                stopping = 1; /* enough jobs deleted: stop issuing reserves */
            }
            if (finished) {
                t_win_end = t_last_reply ? t_last_reply : t;
                srv1 = proc_cpu_ticks(opt_pid);
                cpu1 = cpu_ns();
                measuring = 0;
                break;
            }
        } else if (stopping && (outstanding == 0 || t >= t_grace_end)) {
            break;
        }
        int timeout_ms = 100;
        if (!by_count && !stopping) {
            uint64_t next = measuring ? t_stop : t_measure;
            timeout_ms = next > t ? (int)((next - t) / 1000000ULL) + 1 : 0;
            if (timeout_ms > 100) timeout_ms = 100;
        }
        int n = epoll_wait(epfd, evs, opt_conns, timeout_ms);
        if (n < 0) {
            if (errno == EINTR) continue;
            die("epoll_wait");
        }
        t = now_ns();
        if (measuring && n > 0) wakeups++;
        for (int i = 0; i < n; i++) {
            conn_t *c = evs[i].data.ptr;
            if (!c->alive) continue;
            if (evs[i].events & (EPOLLIN | EPOLLERR | EPOLLHUP)) on_readable(c, t);
            if (!c->alive) continue;
            refill(c, t);
            flush(c);
        }
    }
    if (!t_win_end) t_win_end = now_ns();
    if (!cpu1) { cpu1 = cpu_ns(); srv1 = proc_cpu_ticks(opt_pid); }
    if (opt_step) step("finished");
    for (int i = 0; i < opt_conns; i++)
        if (conns[i].alive) close(conns[i].fd);

    double secs = (double)(t_win_end - t_win_start) / 1e9;
    if (secs <= 0) secs = 1e-9;
    double ccpu_us = (double)(cpu1 - cpu0) / 1000.0;
    double tick_us = 1e6 / (double)sysconf(_SC_CLK_TCK);
    const char *wname = opt_workload == W_PUT ? "put" : opt_workload == W_CYCLE ? "cycle" : "drain";
    printf("{\"workload\": \"%s\", \"conns\": %d, \"depth\": %d, \"body\": %d, \"tube\": \"%s\", "
           "\"seconds\": %.4f, \"ops\": %lld, \"ops_per_s\": %.1f, \"jobs\": %lld, \"jobs_per_s\": %.1f, "
           "\"lat_us\": {\"p50\": %.1f, \"p90\": %.1f, \"p99\": %.1f, \"p999\": %.1f, \"max\": %.1f, \"mean\": %.1f}, "
           "\"errors\": %lld, \"timed_out\": %lld, \"deadline_soon\": %lld, \"conn_errors\": %lld, \"first_error\": \"%s\", "
           "\"ops_total\": %lld, \"client_cpu_us\": %.0f, \"client_cpu_pct\": %.1f, \"client_cpu_us_per_op\": %.3f",
           wname, opt_conns, opt_depth, opt_body, opt_tube, secs, ops_win, ops_win / secs, jobs_win, jobs_win / secs,
           percentile_us(0.50), percentile_us(0.90), percentile_us(0.99), percentile_us(0.999), lat_max / 1000.0,
           lat_n ? (double)lat_sum / (double)lat_n / 1000.0 : 0.0, err_count, timed_out, deadline_soon, conn_errors,
           first_err, ops_total, ccpu_us, 100.0 * ccpu_us / (secs * 1e6), ops_win ? ccpu_us / (double)ops_win : 0.0);
    if (opt_pid > 0 && srv0 >= 0 && srv1 >= 0) {
        double s_us = (double)(srv1 - srv0) * tick_us;
        double u_us = (double)(srv_user1 - srv_user0) * tick_us;
        printf(", \"server_pid\": %d, \"server_cpu_us\": %.0f, \"server_cpu_pct\": %.1f, \"server_cpu_us_per_op\": %.3f"
               ", \"server_user_us_per_op\": %.3f, \"server_sys_us_per_op\": %.3f",
               opt_pid, s_us, 100.0 * s_us / (secs * 1e6), ops_win ? s_us / (double)ops_win : 0.0,
               ops_win ? u_us / (double)ops_win : 0.0, ops_win ? (s_us - u_us) / (double)ops_win : 0.0);
    }
    printf(", \"io\": {\"reads\": %lld, \"read_bytes\": %lld, \"replies_per_read\": %.2f, \"bytes_per_read\": %.1f, "
           "\"writes\": %lld, \"cmds_per_write\": %.2f, \"wakeups\": %lld, \"buckets\": \"0,1,2,3-4,5-8,9-16,17-32,33-64,"
           "65-128,129-256,257+\", \"read_hist\": [",
           rd_calls, rd_bytes, rd_calls ? (double)rd_replies / (double)rd_calls : 0.0,
           rd_calls ? (double)rd_bytes / (double)rd_calls : 0.0, wr_calls,
           wr_calls ? (double)wr_cmds / (double)wr_calls : 0.0, wakeups);
    for (int i = 0; i < IOB; i++) printf("%s%lld", i ? ", " : "", rd_hist[i]);
    printf("], \"write_hist\": [");
    for (int i = 0; i < IOB; i++) printf("%s%lld", i ? ", " : "", wr_hist[i]);
    printf("]}}\n");
    return (conn_errors || err_count) ? 1 : 0;
}
