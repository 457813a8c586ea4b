/*
 * slurm-straggler SPANK plugin: lets each job choose its straggler policy at submit time.
 *
 *   sbatch --straggler-policy=evict --straggler-max-requeues=1 train.sbatch
 *
 * plugstack.conf:
 *   optional /path/straggler_spank.so policies=observe,evict,evict-aggressive,off default=observe
 *            autoload=/path/slurm_plugin/telemetry/autoload telemetry=off
 *
 * --straggler-telemetry=auto (or telemetry=auto in plugstack.conf, for every job) puts the
 * autoload directory first on the tasks' PYTHONPATH and sets STRAGGLER_AUTO=1: every PyTorch
 * rank reports its timings with no change to the training script (the code-free mode);
 * --straggler-telemetry=off turns it off for one job.
 *
 * Values reach the prolog/epilog as SPANK_STRAGGLER_* (spank_job_control_setenv in the
 * allocator/local context) and the job's tasks as STRAGGLER_* (spank_setenv in the remote
 * user_init), so the in-job reporter knows its policy. Invalid values fail the submission with
 * a message that lists the valid ones.
 */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <slurm/spank.h>

SPANK_PLUGIN(straggler, 1);

#define NAME_MAX_LEN 63
#define LIST_MAX_LEN 1023
#define PATH_MAX_LEN 1023
#define ENV_MAX_LEN 8191

static char allowed[LIST_MAX_LEN + 1] = "observe,evict,evict-aggressive,off";
static char default_policy[NAME_MAX_LEN + 1] = "observe";
static char policy[NAME_MAX_LEN + 1] = "";
static char max_requeues[16] = "";
static char min_slowdown[16] = "";
static char notify[16] = "";
static char recovery[16] = "";
static char telemetry[16] = "";
static char telemetry_default[16] = "off";
static char autoload[PATH_MAX_LEN + 1] = "";

static int copy_value(char *dst, size_t size, const char *src)
{
    if (src == NULL || strlen(src) >= size)
        return -1;
    memcpy(dst, src, strlen(src) + 1);
    return 0;
}

static int is_allowed(const char *name)
{
    char list[LIST_MAX_LEN + 1];
    char *save = NULL;
    char *item;

    if (copy_value(list, sizeof(list), allowed) < 0)
        return 0;
    for (item = strtok_r(list, ",", &save); item; item = strtok_r(NULL, ",", &save)) {
        if (strcmp(item, name) == 0)
            return 1;
    }
    return 0;
}

static int opt_policy(int val, const char *optarg, int remote)
{
    (void)val;
    (void)remote;
    if (optarg == NULL || !is_allowed(optarg)) {
        slurm_error("straggler: invalid --straggler-policy '%s'; valid policies: %s",
                    optarg ? optarg : "", allowed);
        return -1;
    }
    return copy_value(policy, sizeof(policy), optarg);
}

static int opt_max_requeues(int val, const char *optarg, int remote)
{
    char *end = NULL;
    long n;

    (void)val;
    (void)remote;
    errno = 0;
    n = optarg ? strtol(optarg, &end, 10) : -1;
    if (optarg == NULL || errno != 0 || end == optarg || *end != '\0' || n < 0 || n > 100) {
        slurm_error("straggler: --straggler-max-requeues must be an integer 0..100, not '%s'",
                    optarg ? optarg : "");
        return -1;
    }
    return copy_value(max_requeues, sizeof(max_requeues), optarg);
}

static int opt_min_slowdown(int val, const char *optarg, int remote)
{
    char *end = NULL;
    double pct;

    (void)val;
    (void)remote;
    errno = 0;
    pct = optarg ? strtod(optarg, &end) : -1.0;
    if (optarg == NULL || errno != 0 || end == optarg || *end != '\0' || pct < 0.1
        || pct > 1000.0) {
        slurm_error("straggler: --straggler-min-slowdown must be a percentage 0.1..1000, "
                    "not '%s'", optarg ? optarg : "");
        return -1;
    }
    return copy_value(min_slowdown, sizeof(min_slowdown), optarg);
}

static int opt_notify(int val, const char *optarg, int remote)
{
    (void)val;
    (void)remote;
    if (optarg == NULL || (strcmp(optarg, "off") != 0 && strcmp(optarg, "log") != 0
                           && strcmp(optarg, "comment") != 0)) {
        slurm_error("straggler: --straggler-notify must be off, log or comment, not '%s'",
                    optarg ? optarg : "");
        return -1;
    }
    return copy_value(notify, sizeof(notify), optarg);
}

static int opt_recovery(int val, const char *optarg, int remote)
{
    (void)val;
    (void)remote;
    if (optarg == NULL || (strcmp(optarg, "requeue") != 0 && strcmp(optarg, "advice") != 0)) {
        slurm_error("straggler: --straggler-recovery must be requeue or advice, not '%s'",
                    optarg ? optarg : "");
        return -1;
    }
    return copy_value(recovery, sizeof(recovery), optarg);
}

static int is_telemetry_mode(const char *value)
{
    return value != NULL && (strcmp(value, "auto") == 0 || strcmp(value, "off") == 0);
}

static int opt_telemetry(int val, const char *optarg, int remote)
{
    (void)val;
    (void)remote;
    if (!is_telemetry_mode(optarg)) {
        slurm_error("straggler: --straggler-telemetry must be auto or off, not '%s'",
                    optarg ? optarg : "");
        return -1;
    }
    return copy_value(telemetry, sizeof(telemetry), optarg);
}

static struct spank_option options[] = {
    {"straggler-policy", "NAME",
     "Straggler policy of this job (see `straggler policy list`).", 1, 0, opt_policy},
    {"straggler-max-requeues", "N",
     "Evict this job at most N times (within the policy's limit).", 1, 0, opt_max_requeues},
    {"straggler-min-slowdown", "PCT",
     "Only act on slowdowns of at least PCT percent (not below the policy's).", 1, 0,
     opt_min_slowdown},
    {"straggler-notify", "off|log|comment",
     "How the job hears about detections.", 1, 0, opt_notify},
    {"straggler-recovery", "requeue|advice",
     "advice: told first which nodes to leave, requeued only if it does not.", 1, 0,
     opt_recovery},
    {"straggler-telemetry", "auto|off",
     "auto: every PyTorch rank reports its timings, no code change; off: only explicit calls.",
     1, 0, opt_telemetry},
    SPANK_OPTIONS_TABLE_END
};

static int parse_args(int ac, char **av)
{
    int i;

    for (i = 0; i < ac; i++) {
        if (strncmp(av[i], "policies=", 9) == 0) {
            if (copy_value(allowed, sizeof(allowed), av[i] + 9) < 0)
                return -1;
        } else if (strncmp(av[i], "default=", 8) == 0) {
            if (copy_value(default_policy, sizeof(default_policy), av[i] + 8) < 0)
                return -1;
        } else if (strncmp(av[i], "telemetry=", 10) == 0) {
            if (!is_telemetry_mode(av[i] + 10)) {
                slurm_error("straggler: plugstack telemetry= must be auto or off, not '%s'",
                            av[i] + 10);
                return -1;
            }
            copy_value(telemetry_default, sizeof(telemetry_default), av[i] + 10);
        } else if (strncmp(av[i], "autoload=", 9) == 0) {
            if (av[i][9] != '/' || copy_value(autoload, sizeof(autoload), av[i] + 9) < 0) {
                slurm_error("straggler: plugstack autoload= must be an absolute path");
                return -1;
            }
        } else {
            slurm_error("straggler: unknown plugstack argument '%s'", av[i]);
            return -1;
        }
    }
    if (!is_allowed(default_policy)) {
        slurm_error("straggler: default policy '%s' is not in policies=%s", default_policy,
                    allowed);
        return -1;
    }
    return 0;
}

int slurm_spank_init(spank_t sp, int ac, char **av)
{
    struct spank_option *opt;

    if (parse_args(ac, av) < 0)
        return -1;
    for (opt = options; opt->name != NULL; opt++) {
        if (spank_option_register(sp, opt) != ESPANK_SUCCESS) {
            slurm_error("straggler: cannot register --%s", opt->name);
            return -1;
        }
    }
    return 0;
}

static int export_job_control(spank_t sp, const char *name, const char *value)
{
    if (value[0] == '\0')
        return 0;
    return spank_job_control_setenv(sp, name, value, 1) == ESPANK_SUCCESS ? 0 : -1;
}

int slurm_spank_init_post_opt(spank_t sp, int ac, char **av)
{
    spank_context_t ctx = spank_context();

    (void)ac;
    (void)av;
    if (ctx != S_CTX_ALLOCATOR && ctx != S_CTX_LOCAL)
        return 0;
    if (export_job_control(sp, "STRAGGLER_POLICY", policy) < 0
        || export_job_control(sp, "STRAGGLER_MAX_REQUEUES", max_requeues) < 0
        || export_job_control(sp, "STRAGGLER_MIN_SLOWDOWN", min_slowdown) < 0
        || export_job_control(sp, "STRAGGLER_NOTIFY", notify) < 0
        || export_job_control(sp, "STRAGGLER_RECOVERY", recovery) < 0) {
        slurm_error("straggler: cannot pass the options to the job");
        return -1;
    }
    return 0;
}

static void export_task(spank_t sp, const char *name, const char *value)
{
    if (value[0] != '\0')
        spank_setenv(sp, name, value, 1);
}

/* Whether the ':'-separated list has an entry equal to dir. */
static int path_has(const char *list, const char *dir)
{
    size_t len = strlen(dir);
    const char *p = list;

    while (*p) {
        const char *end = strchr(p, ':');
        size_t n = end ? (size_t)(end - p) : strlen(p);

        if (n == len && strncmp(p, dir, len) == 0)
            return 1;
        if (!end)
            break;
        p = end + 1;
    }
    return 0;
}

/* The code-free mode: the autoload directory first on the tasks' PYTHONPATH (once: a step
 * inside a batch job inherits it from the batch step). */
static void export_telemetry(spank_t sp)
{
    const char *mode = telemetry[0] ? telemetry : telemetry_default;
    char old[ENV_MAX_LEN + 1] = "";
    char path[ENV_MAX_LEN + 1];
    int n;

    if (strcmp(mode, "auto") != 0) {
        spank_setenv(sp, "STRAGGLER_AUTO", "0", 1);
        return;
    }
    if (autoload[0] == '\0') {
        slurm_info("straggler: --straggler-telemetry=auto needs autoload= in plugstack.conf; "
                   "the job runs without code-free telemetry");
        return;
    }
    if (spank_getenv(sp, "PYTHONPATH", old, sizeof(old)) != ESPANK_SUCCESS)
        old[0] = '\0';
    spank_setenv(sp, "STRAGGLER_AUTO", "1", 1);
    if (path_has(old, autoload))
        return;
    n = old[0] ? snprintf(path, sizeof(path), "%s:%s", autoload, old)
               : snprintf(path, sizeof(path), "%s", autoload);
    if (n < 0 || (size_t)n >= sizeof(path)) {
        slurm_info("straggler: PYTHONPATH too long; the job runs without code-free telemetry");
        return;
    }
    spank_setenv(sp, "PYTHONPATH", path, 1);
}

int slurm_spank_user_init(spank_t sp, int ac, char **av)
{
    (void)ac;
    (void)av;
    if (spank_remote(sp) != 1)
        return 0;
    export_task(sp, "STRAGGLER_POLICY", policy[0] ? policy : default_policy);
    export_task(sp, "STRAGGLER_MAX_REQUEUES", max_requeues);
    export_task(sp, "STRAGGLER_MIN_SLOWDOWN", min_slowdown);
    export_task(sp, "STRAGGLER_NOTIFY", notify);
    export_task(sp, "STRAGGLER_RECOVERY", recovery);
    export_telemetry(sp);
    return 0;
}
