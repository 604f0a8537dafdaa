/* A function that tries to outlive its allocation, for the tests of its
 * cgroup. Not for production libraries. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

/* Starts a process that escapes as far as an unprivileged one can: it
 * forks twice (its parent exits, so the worker is not its parent), calls
 * setsid, ignores SIGTERM, SIGINT and SIGHUP, re-pins itself to every CPU
 * (sched_setaffinity), and then burns CPU until killed, appending
 * "cpu N\n" to the file named by the input (a path, without a NUL) each
 * time it finds itself on a CPU it had not run on before. Returns, once
 * the process has re-pinned itself and written its first line, its pid
 * (a u32); 0 when it could not start it. The file must be one the lease's
 * user may create. */
uint32_t escape_fork(void *in, uint32_t in_len, void *out)
{
    char path[256];
    int ready[2];
    uint32_t pid = 0;
    if (in_len == 0 || in_len >= sizeof path || pipe(ready) != 0)
        return 0;
    memcpy(path, in, in_len);
    path[in_len] = '\0';
    pid_t first = fork();
    if (first == 0) {
        setsid();
        if (fork() != 0)
            _exit(0);
        signal(SIGTERM, SIG_IGN);
        signal(SIGINT, SIG_IGN);
        signal(SIGHUP, SIG_IGN);
        cpu_set_t every;
        CPU_ZERO(&every);
        for (int c = 0; c < CPU_SETSIZE; c++)
            CPU_SET(c, &every);
        sched_setaffinity(0, sizeof every, &every);
        int log = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
        uint32_t me = (uint32_t)getpid();
        int told = 0;
        unsigned char seen[CPU_SETSIZE] = {0};
        for (;;) {
            int cpu = sched_getcpu();
            if (cpu >= 0 && cpu < CPU_SETSIZE && !seen[cpu]) {
                char line[32];
                int n = snprintf(line, sizeof line, "cpu %d\n", cpu);
                seen[cpu] = 1;
                if (log >= 0 && write(log, line, (size_t)n) != n)
                    _exit(1);
            }
            if (!told) {
                /* A short write leaves the caller's read at 0. */
                ssize_t w = write(ready[1], &me, sizeof me);
                (void)w;
                close(ready[1]);
                told = 1;
            }
        }
    }
    close(ready[1]);
    if (first > 0) {
        waitpid(first, NULL, 0);
        if (read(ready[0], &pid, sizeof pid) != sizeof pid)
            pid = 0;
    }
    close(ready[0]);
    memcpy(out, &pid, sizeof pid);
    return sizeof pid;
}
