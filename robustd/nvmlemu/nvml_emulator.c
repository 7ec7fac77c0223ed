/*
 * robustd's NVML emulator: a libnvidia-ml.so.1 for hosts without an NVIDIA driver.
 *
 * Compiled against NVIDIA's own nvml.h (PyPI nvidia-nvml-dev), so every signature and struct
 * is the real one and the real pynvml code path runs end to end. The emulated GPUs come from
 * a text state file named by $ROBUSTD_NVML_EMULATOR_STATE (format: robustd/nvmlemu/state.py),
 * read at nvmlInit and re-read whenever it changes: every call stats it (cheap), so a test or
 * `robustctl sim` can inject a fault into a running daemon.
 *
 * Per-GPU faults: "lost" (calls return NVML_ERROR_GPU_IS_LOST), "hang" (calls block until the
 * fault is cleared from the file, as a GPU that fell off the bus does), "vanish" (the GPU drops
 * out of the device count; its old handle reports GPU_IS_LOST). Metric faults are just values.
 * Calls robustd does not use are generated stubs returning NVML_ERROR_NOT_SUPPORTED (build.py).
 *
 * Events (nvmlEventSetCreate / nvmlDeviceRegisterEvents / nvmlEventSetWait_v2 / nvmlEventSetFree):
 * the state file lists each GPU's recent events as `seq:type:data:time_ns` (written by
 * `robustctl sim`). Whenever the file is re-read, events with a seq this process has not seen yet
 * are handed to every event set that had registered that GPU and type *at the event's time*, as
 * the driver does: nothing is queued for sets registered later. A GPU's `event_floor` (raised by
 * `clear`) discards its events not yet delivered. A waiter sleeps on inotify for the state file's directory
 * (or, without inotify, looks at the file every EMU_EVENT_POLL_NS);
 * while a GPU in the set has the "hang" fault the wait blocks past its timeout, as a hung driver does.
 *
 * NVLink fabric (nvmlDeviceGetGpuFabricInfoV, v2 and v3 structs; the unversioned legacy call too): each
 * GPU's fabric_state / fabric_status / fabric_clique / fabric_cluster_uuid / fabric_health_mask from the
 * file; fabric_state -1 makes the call answer NOT_SUPPORTED, as pre-Hopper GPUs do.
 *
 * Settings (application clocks, power limit, persistence, compute, ECC and MIG modes): getters read the file;
 * the setters robustd restores with (SetApplicationsClocks, ResetApplicationsClocks, SetPowerManagementLimit,
 * SetPersistenceMode, SetComputeMode) write their key back into it, so another process (a test's fake dcgmi,
 * the daemon) sees the change. A GPU's set_error makes every setter fail with it. Locked clocks have no getter
 * in NVML, so none here either.
 */
#define NVML_NO_UNVERSIONED_FUNC_DEFS 1
#include <nvml.h>

#include <poll.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define EMU_MAX_GPUS 16
#define EMU_MAX_LINKS 18
#define EMU_MAX_PROCS 64
#define EMU_ERR_COUNTERS 5
#define EMU_STR 96
#define EMU_HANG_POLL_NS 20000000L /* 20 ms between looks at the state file while hung */
#define EMU_MAX_EVENTS 64           /* events per GPU in the state file (the newest) */
#define EMU_MAX_SETS 32             /* event sets alive at once */
#define EMU_SET_QUEUE 256           /* undelivered events per set; more are dropped, as a full driver buffer */
#define EMU_EVENT_BITS 16           /* nvmlEventType bits the emulator knows (0x1 .. 0x8000) */
#define EMU_EVENT_POLL_NS 100000000L /* 100 ms: a waiter's look at the state file when inotify is unavailable */
#define EMU_EVENT_TYPES_ALL 0xfe9fULL /* nvmlEventTypeAll */

_Static_assert(NVML_ERROR_NOT_SUPPORTED == 3, "stubs.c returns 3 for NOT_SUPPORTED");

struct emu_gpu {
    char name[EMU_STR], uuid[EMU_STR], bus_id[EMU_STR];
    unsigned int pci_device_id;
    int temperature, temp_slowdown, temp_shutdown, temp_gpu_max;
    unsigned long long reasons;
    unsigned long long ecc_sbe_vol, ecc_dbe_vol, ecc_sbe_agg, ecc_dbe_agg;
    unsigned int remap_cor, remap_unc, remap_pending, remap_failure;
    unsigned int pcie_width, pcie_max_width, pcie_gen, pcie_max_gen, pcie_gpu_max_gen, pcie_replay;
    unsigned int nvlink_count;
    int nvlink_down[EMU_MAX_LINKS];
    unsigned long long nvlink_errors[EMU_MAX_LINKS][EMU_ERR_COUNTERS];
    long long power_mw;
    int sm_clock_mhz; /* nvmlDeviceGetClockInfo(NVML_CLOCK_SM / GRAPHICS); negative: NOT_SUPPORTED */
    unsigned int util_gpu, util_mem;
    unsigned int nprocs;
    unsigned int proc_pid[EMU_MAX_PROCS];
    unsigned long long proc_mem[EMU_MAX_PROCS];
    int lost, hang, vanish;
    unsigned long long event_types, event_floor;
    unsigned int recovery_action;
    int fabric_state; /* NVML_GPU_FABRIC_STATE_*, or -1: the fabric call is NOT_SUPPORTED */
    unsigned int fabric_status, fabric_clique, fabric_health_mask;
    unsigned char fabric_cluster_uuid[NVML_GPU_FABRIC_UUID_LEN];
    /* Settings a stop-time test may change (-1: the getter answers NOT_SUPPORTED); setters write them back. */
    long long app_clock_graphics, app_clock_mem, app_clock_default_graphics, app_clock_default_mem;
    long long power_limit_mw, persistence_mode, compute_mode, ecc_mode, ecc_pending, mig_mode, mig_pending;
    unsigned int set_error; /* non-zero: every setter answers this nvmlReturn_t (e.g. 4 NO_PERMISSION) */
    unsigned int nevents;
    struct emu_event {
        unsigned long long seq, type, data;
        long long time_ns;
    } events[EMU_MAX_EVENTS];
};

struct emu_state {
    char driver_version[EMU_STR], nvml_version[EMU_STR];
    int init_error;
    unsigned int ngpus;
    struct emu_gpu gpus[EMU_MAX_GPUS];
};

struct nvmlDevice_st {
    unsigned int slot;
};

struct emu_queued {
    unsigned int slot;
    unsigned long long seq, type, data;
};

struct nvmlEventSet_st {
    int used;
    long long registered_at[EMU_MAX_GPUS][EMU_EVENT_BITS]; /* CLOCK_REALTIME ns; 0: not registered */
    unsigned int head, count;
    struct emu_queued queue[EMU_SET_QUEUE];
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct emu_state state;
static struct nvmlDevice_st handles[EMU_MAX_GPUS];
static int init_count;
static int have_state;
static struct stat seen; /* identity of the file last read */
static struct nvmlEventSet_st sets[EMU_MAX_SETS];
static unsigned long long handed_seq; /* events up to this seq have been handed to the sets */

/* ---- state file ------------------------------------------------------------------------- */

static char *trim(char *s) {
    while (*s == ' ' || *s == '\t') s++;
    char *end = s + strlen(s);
    while (end > s && (end[-1] == ' ' || end[-1] == '\t' || end[-1] == '\n' || end[-1] == '\r')) *--end = 0;
    return s;
}

static void copy_str(char *dst, const char *src) { snprintf(dst, EMU_STR, "%s", src); }

static unsigned long long num(const char *v) { return strtoull(v, NULL, 0); }

/* "5ef1a7c0-0b3e-..." (hex digits, dashes skipped) into the 16 bytes of a fabric cluster uuid. */
static void parse_uuid(unsigned char out[NVML_GPU_FABRIC_UUID_LEN], const char *v) {
    memset(out, 0, NVML_GPU_FABRIC_UUID_LEN);
    unsigned int nibbles = 0;
    for (const char *c = v; *c && nibbles < 2 * NVML_GPU_FABRIC_UUID_LEN; c++) {
        int d = (*c >= '0' && *c <= '9') ? *c - '0' : (*c >= 'a' && *c <= 'f') ? *c - 'a' + 10
              : (*c >= 'A' && *c <= 'F') ? *c - 'A' + 10 : -1;
        if (d < 0) continue;
        out[nibbles / 2] |= (unsigned char)(nibbles % 2 ? d : d << 4);
        nibbles++;
    }
}

static void parse_list(struct emu_gpu *g, const char *key, const char *value) {
    char buf[1024];
    snprintf(buf, sizeof buf, "%s", value);
    char *save = NULL;
    for (char *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        tok = trim(tok);
        if (!*tok) continue;
        if (strcmp(key, "nvlink_down") == 0) {
            long link = strtol(tok, NULL, 0);
            if (link >= 0 && link < EMU_MAX_LINKS) g->nvlink_down[link] = 1;
        } else if (strcmp(key, "nvlink_errors") == 0) {
            unsigned long link = 0, counter = 0;
            unsigned long long v = 0;
            if (sscanf(tok, "%lu:%lu:%llu", &link, &counter, &v) == 3 && link < EMU_MAX_LINKS &&
                counter < EMU_ERR_COUNTERS)
                g->nvlink_errors[link][counter] = v;
        } else if (strcmp(key, "processes") == 0) {
            unsigned int pid = 0;
            unsigned long long mem = 0;
            if (sscanf(tok, "%u:%llu", &pid, &mem) >= 1 && g->nprocs < EMU_MAX_PROCS) {
                g->proc_pid[g->nprocs] = pid;
                g->proc_mem[g->nprocs++] = mem;
            }
        } else if (strcmp(key, "events") == 0) {
            struct emu_event e = {0, 0, 0, 0};
            if (sscanf(tok, "%llu:%llx:%llu:%lld", &e.seq, &e.type, &e.data, &e.time_ns) == 4 &&
                g->nevents < EMU_MAX_EVENTS)
                g->events[g->nevents++] = e;
        } else if (strcmp(key, "faults") == 0) {
            if (strcmp(tok, "lost") == 0) g->lost = 1;
            else if (strcmp(tok, "hang") == 0) g->hang = 1;
            else if (strcmp(tok, "vanish") == 0) g->vanish = 1;
        }
    }
}

static void set_gpu_key(struct emu_gpu *g, const char *k, const char *v) {
    if (strcmp(k, "name") == 0) copy_str(g->name, v);
    else if (strcmp(k, "uuid") == 0) copy_str(g->uuid, v);
    else if (strcmp(k, "bus_id") == 0) copy_str(g->bus_id, v);
    else if (strcmp(k, "pci_device_id") == 0) g->pci_device_id = (unsigned int)num(v);
    else if (strcmp(k, "temperature") == 0) g->temperature = atoi(v);
    else if (strcmp(k, "temp_slowdown") == 0) g->temp_slowdown = atoi(v);
    else if (strcmp(k, "temp_shutdown") == 0) g->temp_shutdown = atoi(v);
    else if (strcmp(k, "temp_gpu_max") == 0) g->temp_gpu_max = atoi(v);
    else if (strcmp(k, "clocks_event_reasons") == 0) g->reasons = num(v);
    else if (strcmp(k, "ecc_sbe_volatile") == 0) g->ecc_sbe_vol = num(v);
    else if (strcmp(k, "ecc_dbe_volatile") == 0) g->ecc_dbe_vol = num(v);
    else if (strcmp(k, "ecc_sbe_aggregate") == 0) g->ecc_sbe_agg = num(v);
    else if (strcmp(k, "ecc_dbe_aggregate") == 0) g->ecc_dbe_agg = num(v);
    else if (strcmp(k, "remap_correctable") == 0) g->remap_cor = (unsigned int)num(v);
    else if (strcmp(k, "remap_uncorrectable") == 0) g->remap_unc = (unsigned int)num(v);
    else if (strcmp(k, "remap_pending") == 0) g->remap_pending = (unsigned int)num(v);
    else if (strcmp(k, "remap_failure") == 0) g->remap_failure = (unsigned int)num(v);
    else if (strcmp(k, "pcie_width") == 0) g->pcie_width = (unsigned int)num(v);
    else if (strcmp(k, "pcie_max_width") == 0) g->pcie_max_width = (unsigned int)num(v);
    else if (strcmp(k, "pcie_gen") == 0) g->pcie_gen = (unsigned int)num(v);
    else if (strcmp(k, "pcie_max_gen") == 0) g->pcie_max_gen = (unsigned int)num(v);
    else if (strcmp(k, "pcie_gpu_max_gen") == 0) g->pcie_gpu_max_gen = (unsigned int)num(v);
    else if (strcmp(k, "pcie_replay") == 0) g->pcie_replay = (unsigned int)num(v);
    else if (strcmp(k, "nvlink_count") == 0) {
        unsigned long long n = num(v);
        g->nvlink_count = n > EMU_MAX_LINKS ? EMU_MAX_LINKS : (unsigned int)n;
    } else if (strcmp(k, "power_mw") == 0) g->power_mw = strtoll(v, NULL, 0);
    else if (strcmp(k, "sm_clock_mhz") == 0) g->sm_clock_mhz = atoi(v);
    else if (strcmp(k, "utilization_gpu") == 0) g->util_gpu = (unsigned int)num(v);
    else if (strcmp(k, "utilization_memory") == 0) g->util_mem = (unsigned int)num(v);
    else if (strcmp(k, "event_types") == 0) g->event_types = num(v);
    else if (strcmp(k, "event_floor") == 0) g->event_floor = num(v);
    else if (strcmp(k, "recovery_action") == 0) g->recovery_action = (unsigned int)num(v);
    else if (strcmp(k, "fabric_state") == 0) g->fabric_state = atoi(v);
    else if (strcmp(k, "fabric_status") == 0) g->fabric_status = (unsigned int)num(v);
    else if (strcmp(k, "fabric_clique") == 0) g->fabric_clique = (unsigned int)num(v);
    else if (strcmp(k, "fabric_health_mask") == 0) g->fabric_health_mask = (unsigned int)num(v);
    else if (strcmp(k, "fabric_cluster_uuid") == 0) parse_uuid(g->fabric_cluster_uuid, v);
    else if (strcmp(k, "app_clock_graphics") == 0) g->app_clock_graphics = strtoll(v, NULL, 0);
    else if (strcmp(k, "app_clock_mem") == 0) g->app_clock_mem = strtoll(v, NULL, 0);
    else if (strcmp(k, "app_clock_default_graphics") == 0) g->app_clock_default_graphics = strtoll(v, NULL, 0);
    else if (strcmp(k, "app_clock_default_mem") == 0) g->app_clock_default_mem = strtoll(v, NULL, 0);
    else if (strcmp(k, "power_limit_mw") == 0) g->power_limit_mw = strtoll(v, NULL, 0);
    else if (strcmp(k, "persistence_mode") == 0) g->persistence_mode = strtoll(v, NULL, 0);
    else if (strcmp(k, "compute_mode") == 0) g->compute_mode = strtoll(v, NULL, 0);
    else if (strcmp(k, "ecc_mode") == 0) g->ecc_mode = strtoll(v, NULL, 0);
    else if (strcmp(k, "ecc_pending") == 0) g->ecc_pending = strtoll(v, NULL, 0);
    else if (strcmp(k, "mig_mode") == 0) g->mig_mode = strtoll(v, NULL, 0);
    else if (strcmp(k, "mig_pending") == 0) g->mig_pending = strtoll(v, NULL, 0);
    else if (strcmp(k, "set_error") == 0) g->set_error = (unsigned int)num(v);
    else parse_list(g, k, v); /* nvlink_down, nvlink_errors, processes, faults; unknown keys ignored */
}

/* Parse into a fresh struct; 0 on success. The caller keeps the old state on failure. */
static int read_state(const char *path, struct emu_state *out) {
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    memset(out, 0, sizeof *out);
    copy_str(out->driver_version, "550.54.15");
    copy_str(out->nvml_version, "12.550.54.15");
    struct emu_gpu *g = NULL;
    char line[2048];
    while (fgets(line, sizeof line, f)) {
        char *hash = strchr(line, '#');
        if (hash) *hash = 0;
        char *s = trim(line);
        if (!*s) continue;
        unsigned int idx;
        if (sscanf(s, "[gpu %u]", &idx) == 1) {
            if (out->ngpus >= EMU_MAX_GPUS) break;
            g = &out->gpus[out->ngpus++];
            g->event_types = EMU_EVENT_TYPES_ALL;
            g->fabric_state = NVML_GPU_FABRIC_STATE_COMPLETED;
            g->app_clock_graphics = g->app_clock_mem = g->app_clock_default_graphics = g->app_clock_default_mem = -1;
            g->power_limit_mw = g->persistence_mode = g->compute_mode = -1;
            g->ecc_mode = g->ecc_pending = g->mig_mode = g->mig_pending = -1;
            continue;
        }
        char *eq = strchr(s, '=');
        if (!eq) continue;
        *eq = 0;
        char *k = trim(s), *v = trim(eq + 1);
        if (g) set_gpu_key(g, k, v);
        else if (strcmp(k, "driver_version") == 0) copy_str(out->driver_version, v);
        else if (strcmp(k, "nvml_version") == 0) copy_str(out->nvml_version, v);
        else if (strcmp(k, "init_error") == 0) out->init_error = atoi(v);
    }
    fclose(f);
    return 0;
}

static int event_bit(unsigned long long type) {
    for (int b = 0; b < EMU_EVENT_BITS; b++)
        if (type == (1ULL << b)) return b;
    return -1;
}

/* With the lock held, after a read: hand new events to the sets registered for them when they
 * happened, and drop queued events that `clear` discarded (seq at or below their GPU's floor). */
static void hand_out_events_locked(int first_read) {
    unsigned long long newest = handed_seq;
    for (unsigned int i = 0; i < state.ngpus; i++) {
        struct emu_gpu *g = &state.gpus[i];
        for (unsigned int j = 0; j < g->nevents; j++) {
            struct emu_event *e = &g->events[j];
            if (e->seq > newest) newest = e->seq;
            int bit = event_bit(e->type);
            if (first_read || e->seq <= handed_seq || e->seq <= g->event_floor || bit < 0) continue;
            for (int s = 0; s < EMU_MAX_SETS; s++) {
                struct nvmlEventSet_st *set = &sets[s];
                long long at = set->registered_at[i][bit];
                if (!set->used || at == 0 || at > e->time_ns) continue;
                if (set->count >= EMU_SET_QUEUE) continue; /* a full buffer loses the event */
                set->queue[(set->head + set->count++) % EMU_SET_QUEUE] = (struct emu_queued){i, e->seq, e->type, e->data};
            }
        }
    }
    handed_seq = newest;
    for (int s = 0; s < EMU_MAX_SETS; s++) {
        struct nvmlEventSet_st *set = &sets[s];
        if (!set->used || !set->count) continue;
        unsigned int kept = 0;
        struct emu_queued keep[EMU_SET_QUEUE];
        for (unsigned int q = 0; q < set->count; q++) {
            struct emu_queued *e = &set->queue[(set->head + q) % EMU_SET_QUEUE];
            if (e->slot < state.ngpus && e->seq <= state.gpus[e->slot].event_floor) continue;
            keep[kept++] = *e;
        }
        memcpy(set->queue, keep, kept * sizeof keep[0]);
        set->head = 0;
        set->count = kept;
    }
}

/* With the lock held: re-read the file if it was replaced or changed since the last read. */
static void refresh_locked(void) {
    const char *path = getenv("ROBUSTD_NVML_EMULATOR_STATE");
    struct stat st;
    if (!path || stat(path, &st) != 0) return; /* keep the last good state */
    if (have_state && st.st_ino == seen.st_ino && st.st_dev == seen.st_dev && st.st_size == seen.st_size &&
        st.st_mtim.tv_sec == seen.st_mtim.tv_sec && st.st_mtim.tv_nsec == seen.st_mtim.tv_nsec)
        return;
    static struct emu_state fresh;
    if (read_state(path, &fresh) == 0) {
        int first_read = !have_state && handed_seq == 0;
        state = fresh;
        seen = st;
        have_state = 1;
        hand_out_events_locked(first_read); /* events already in the file at the first read are history */
    }
}

/* ---- call entry ------------------------------------------------------------------------- */

/* Lock, refresh and resolve a handle to its GPU. On success returns NVML_SUCCESS with the lock
 * held and *out set; the caller must unlock. A hung GPU blocks here until its fault is cleared. */
static nvmlReturn_t enter(nvmlDevice_t device, struct emu_gpu **out) {
    for (;;) {
        pthread_mutex_lock(&lock);
        if (init_count <= 0) {
            pthread_mutex_unlock(&lock);
            return NVML_ERROR_UNINITIALIZED;
        }
        refresh_locked();
        uintptr_t at = (uintptr_t)device, first = (uintptr_t)&handles[0];
        if (at < first || at >= first + sizeof handles || (at - first) % sizeof handles[0]) {
            pthread_mutex_unlock(&lock);
            return NVML_ERROR_INVALID_ARGUMENT;
        }
        unsigned int slot = device->slot;
        if (slot >= state.ngpus) {
            pthread_mutex_unlock(&lock);
            return NVML_ERROR_GPU_IS_LOST;
        }
        struct emu_gpu *g = &state.gpus[slot];
        if (g->hang) {
            pthread_mutex_unlock(&lock);
            struct timespec ts = {0, EMU_HANG_POLL_NS};
            nanosleep(&ts, NULL);
            continue;
        }
        if (g->lost || g->vanish) {
            pthread_mutex_unlock(&lock);
            return NVML_ERROR_GPU_IS_LOST;
        }
        *out = g;
        return NVML_SUCCESS;
    }
}

static nvmlReturn_t leave(nvmlReturn_t ret) {
    pthread_mutex_unlock(&lock);
    return ret;
}

#define ENTER(device, g)                          \
    struct emu_gpu *g = NULL;                     \
    do {                                          \
        nvmlReturn_t r_ = enter((device), &g);    \
        if (r_ != NVML_SUCCESS) return r_;        \
    } while (0)

/* ---- init and system -------------------------------------------------------------------- */

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    const char *path = getenv("ROBUSTD_NVML_EMULATOR_STATE");
    pthread_mutex_lock(&lock);
    have_state = 0;
    if (!path || !*path) return leave(NVML_ERROR_DRIVER_NOT_LOADED);
    refresh_locked();
    if (!have_state) return leave(NVML_ERROR_DRIVER_NOT_LOADED);
    if (state.init_error) return leave((nvmlReturn_t)state.init_error);
    for (unsigned int i = 0; i < EMU_MAX_GPUS; i++) handles[i].slot = i;
    init_count++;
    return leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void) {
    pthread_mutex_lock(&lock);
    if (init_count <= 0) return leave(NVML_ERROR_UNINITIALIZED);
    init_count--;
    return leave(NVML_SUCCESS);
}

const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_UNKNOWN: return "Unknown Error";
    default: return "Unknown Error (emulated NVML)";
    }
}

static nvmlReturn_t copy_out(char *dst, unsigned int length, const char *src) {
    if (!dst) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(src) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, src, strlen(src) + 1);
    return NVML_SUCCESS;
}

static nvmlReturn_t system_string(char *dst, unsigned int length, int which) {
    pthread_mutex_lock(&lock);
    if (init_count <= 0) return leave(NVML_ERROR_UNINITIALIZED);
    refresh_locked();
    return leave(copy_out(dst, length, which ? state.nvml_version : state.driver_version));
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) { return system_string(version, length, 0); }
nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length) { return system_string(version, length, 1); }

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount) {
    if (!deviceCount) return NVML_ERROR_INVALID_ARGUMENT;
    pthread_mutex_lock(&lock);
    if (init_count <= 0) return leave(NVML_ERROR_UNINITIALIZED);
    refresh_locked();
    unsigned int n = 0;
    for (unsigned int i = 0; i < state.ngpus; i++) n += !state.gpus[i].vanish;
    *deviceCount = n;
    return leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetCount(unsigned int *deviceCount) { return nvmlDeviceGetCount_v2(deviceCount); }

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    if (!device) return NVML_ERROR_INVALID_ARGUMENT;
    pthread_mutex_lock(&lock);
    if (init_count <= 0) return leave(NVML_ERROR_UNINITIALIZED);
    refresh_locked();
    unsigned int seen_visible = 0;
    for (unsigned int i = 0; i < state.ngpus; i++) {
        if (state.gpus[i].vanish) continue;
        if (seen_visible++ == index) {
            *device = &handles[i];
            return leave(NVML_SUCCESS);
        }
    }
    return leave(NVML_ERROR_INVALID_ARGUMENT);
}

nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device) {
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

/* ---- identity --------------------------------------------------------------------------- */

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    ENTER(device, g);
    return leave(copy_out(name, length, g->name));
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    ENTER(device, g);
    return leave(copy_out(uuid, length, g->uuid));
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index) {
    ENTER(device, g);
    if (!index) return leave(NVML_ERROR_INVALID_ARGUMENT);
    *index = (unsigned int)(g - state.gpus);
    return leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    ENTER(device, g);
    if (!pci) return leave(NVML_ERROR_INVALID_ARGUMENT);
    memset(pci, 0, sizeof *pci);
    unsigned int domain = 0, bus = 0, dev = 0, fn = 0;
    sscanf(g->bus_id, "%x:%x:%x.%x", &domain, &bus, &dev, &fn);
    pci->domain = domain;
    pci->bus = bus;
    pci->device = dev;
    pci->pciDeviceId = g->pci_device_id;
    pci->pciSubSystemId = 0x16C110DE;
    snprintf(pci->busId, sizeof pci->busId, NVML_DEVICE_PCI_BUS_ID_FMT, domain, bus, dev);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, NVML_DEVICE_PCI_BUS_ID_LEGACY_FMT, domain, bus, dev);
    return leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t device, nvmlPciInfo_t *pci) { return nvmlDeviceGetPciInfo_v3(device, pci); }
nvmlReturn_t nvmlDeviceGetPciInfo(nvmlDevice_t device, nvmlPciInfo_t *pci) { return nvmlDeviceGetPciInfo_v3(device, pci); }

/* ---- thermal and clocks ----------------------------------------------------------------- */

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, nvmlTemperatureSensors_t sensor, unsigned int *temp) {
    ENTER(device, g);
    if (!temp) return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (sensor != NVML_TEMPERATURE_GPU) return leave(NVML_ERROR_NOT_SUPPORTED);
    *temp = (unsigned int)(g->temperature < 0 ? 0 : g->temperature);
    return leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetTemperatureV(nvmlDevice_t device, nvmlTemperature_t *temperature) {
    ENTER(device, g);
    if (!temperature) return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (temperature->version != nvmlTemperature_v1) return leave(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    if (temperature->sensorType != NVML_TEMPERATURE_GPU) return leave(NVML_ERROR_NOT_SUPPORTED);
    temperature->temperature = g->temperature;
    return leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetTemperatureThreshold(nvmlDevice_t device, nvmlTemperatureThresholds_t type,
                                               unsigned int *temp) {
    ENTER(device, g);
    if (!temp) return leave(NVML_ERROR_INVALID_ARGUMENT);
    switch (type) {
    case NVML_TEMPERATURE_THRESHOLD_SHUTDOWN: *temp = (unsigned int)g->temp_shutdown; break;
    case NVML_TEMPERATURE_THRESHOLD_SLOWDOWN: *temp = (unsigned int)g->temp_slowdown; break;
    case NVML_TEMPERATURE_THRESHOLD_GPU_MAX: *temp = (unsigned int)g->temp_gpu_max; break;
    default: return leave(NVML_ERROR_NOT_SUPPORTED);
    }
    return leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t device, unsigned long long *reasons) {
    ENTER(device, g);
    if (!reasons) return leave(NVML_ERROR_INVALID_ARGUMENT);
    *reasons = g->reasons;
    return leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t device, unsigned long long *reasons) {
    return nvmlDeviceGetCurrentClocksEventReasons(device, reasons);
}

/* The current SM clock; graphics is the same clock domain on these GPUs. Memory and video clocks are not
 * emulated (NOT_SUPPORTED), nor is a state file's negative sm_clock_mhz (a driver that hides clocks). */
nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t device, nvmlClockType_t type, unsigned int *clock) {
    ENTER(device, g);
    if (!clock) return leave(NVML_ERROR_INVALID_ARGUMENT);
    if ((type != NVML_CLOCK_SM && type != NVML_CLOCK_GRAPHICS) || g->sm_clock_mhz < 0)
        return leave(NVML_ERROR_NOT_SUPPORTED);
    *clock = (unsigned int)g->sm_clock_mhz;
    return leave(NVML_SUCCESS);
}

/* ---- memory errors ---------------------------------------------------------------------- */

nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device, nvmlMemoryErrorType_t errorType,
                                         nvmlEccCounterType_t counterType, unsigned long long *eccCounts) {
    ENTER(device, g);
    if (!eccCounts || errorType >= NVML_MEMORY_ERROR_TYPE_COUNT || counterType >= NVML_ECC_COUNTER_TYPE_COUNT)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    int unc = errorType == NVML_MEMORY_ERROR_TYPE_UNCORRECTED, vol = counterType == NVML_VOLATILE_ECC;
    *eccCounts = unc ? (vol ? g->ecc_dbe_vol : g->ecc_dbe_agg) : (vol ? g->ecc_sbe_vol : g->ecc_sbe_agg);
    return leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t device, unsigned int *corrRows, unsigned int *uncRows,
                                       unsigned int *isPending, unsigned int *failureOccurred) {
    ENTER(device, g);
    if (!corrRows || !uncRows || !isPending || !failureOccurred) return leave(NVML_ERROR_INVALID_ARGUMENT);
    *corrRows = g->remap_cor;
    *uncRows = g->remap_unc;
    *isPending = g->remap_pending;
    *failureOccurred = g->remap_failure;
    return leave(NVML_SUCCESS);
}

/* ---- PCIe ------------------------------------------------------------------------------- */

#define UINT_GETTER(fn, field)                                        \
    nvmlReturn_t fn(nvmlDevice_t device, unsigned int *value) {       \
        ENTER(device, g);                                             \
        if (!value) return leave(NVML_ERROR_INVALID_ARGUMENT);        \
        *value = g->field;                                            \
        return leave(NVML_SUCCESS);                                   \
    }

UINT_GETTER(nvmlDeviceGetCurrPcieLinkWidth, pcie_width)
UINT_GETTER(nvmlDeviceGetMaxPcieLinkWidth, pcie_max_width)
UINT_GETTER(nvmlDeviceGetCurrPcieLinkGeneration, pcie_gen)
UINT_GETTER(nvmlDeviceGetMaxPcieLinkGeneration, pcie_max_gen)
UINT_GETTER(nvmlDeviceGetGpuMaxPcieLinkGeneration, pcie_gpu_max_gen)
UINT_GETTER(nvmlDeviceGetPcieReplayCounter, pcie_replay)

/* ---- NVLink ----------------------------------------------------------------------------- */

nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link, nvmlEnableState_t *isActive) {
    ENTER(device, g);
    if (!isActive || link >= g->nvlink_count) return leave(NVML_ERROR_INVALID_ARGUMENT);
    *isActive = g->nvlink_down[link] ? NVML_FEATURE_DISABLED : NVML_FEATURE_ENABLED;
    return leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetNvLinkErrorCounter(nvmlDevice_t device, unsigned int link, nvmlNvLinkErrorCounter_t counter,
                                             unsigned long long *counterValue) {
    ENTER(device, g);
    if (!counterValue || link >= g->nvlink_count || (unsigned int)counter >= EMU_ERR_COUNTERS)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    *counterValue = g->nvlink_errors[link][counter];
    return leave(NVML_SUCCESS);
}

/* ---- power, utilization, processes ------------------------------------------------------ */

nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *power) {
    ENTER(device, g);
    if (!power) return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (g->power_mw < 0) return leave(NVML_ERROR_UNKNOWN);
    *power = (unsigned int)g->power_mw;
    return leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *utilization) {
    ENTER(device, g);
    if (!utilization) return leave(NVML_ERROR_INVALID_ARGUMENT);
    utilization->gpu = g->util_gpu;
    utilization->memory = g->util_mem;
    return leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                     nvmlProcessInfo_t *infos) {
    ENTER(device, g);
    if (!infoCount) return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (*infoCount < g->nprocs || (!infos && g->nprocs)) {
        *infoCount = g->nprocs;
        return leave(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    for (unsigned int i = 0; i < g->nprocs; i++) {
        infos[i].pid = g->proc_pid[i];
        infos[i].usedGpuMemory = g->proc_mem[i];
        infos[i].gpuInstanceId = 0xFFFFFFFFu;
        infos[i].computeInstanceId = 0xFFFFFFFFu;
    }
    *infoCount = g->nprocs;
    return leave(NVML_SUCCESS);
}

/* ---- NVLink fabric --------------------------------------------------------------------- */

/* The v2 and v3 structs share their first fields; v3 adds healthSummary (pynvml's
 * c_nvmlGpuFabricInfoV_t is v2, nvml.h's nvmlGpuFabricInfoV_t v3): only what the caller's version has is
 * written. Another version is ARGUMENT_VERSION_MISMATCH, as the driver answers. */
nvmlReturn_t nvmlDeviceGetGpuFabricInfoV(nvmlDevice_t device, nvmlGpuFabricInfoV_t *info) {
    ENTER(device, g);
    if (!info) return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (info->version != nvmlGpuFabricInfo_v2 && info->version != nvmlGpuFabricInfo_v3)
        return leave(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    if (g->fabric_state < 0) return leave(NVML_ERROR_NOT_SUPPORTED);
    memcpy(info->clusterUuid, g->fabric_cluster_uuid, sizeof info->clusterUuid);
    info->status = (nvmlReturn_t)g->fabric_status;
    info->cliqueId = g->fabric_clique;
    info->state = (nvmlGpuFabricState_t)g->fabric_state;
    info->healthMask = g->fabric_health_mask;
    if (info->version == nvmlGpuFabricInfo_v3) {
        unsigned int bw = g->fabric_health_mask & 0x3;
        info->healthSummary = g->fabric_state == NVML_GPU_FABRIC_STATE_NOT_SUPPORTED ? NVML_GPU_FABRIC_HEALTH_SUMMARY_NOT_SUPPORTED
                            : bw == NVML_GPU_FABRIC_HEALTH_MASK_DEGRADED_BW_TRUE ? NVML_GPU_FABRIC_HEALTH_SUMMARY_LIMITED_CAPACITY
                            : NVML_GPU_FABRIC_HEALTH_SUMMARY_HEALTHY;
    }
    return leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetGpuFabricInfo(nvmlDevice_t device, nvmlGpuFabricInfo_t *info) {
    ENTER(device, g);
    if (!info) return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (g->fabric_state < 0) return leave(NVML_ERROR_NOT_SUPPORTED);
    memcpy(info->clusterUuid, g->fabric_cluster_uuid, sizeof info->clusterUuid);
    info->status = (nvmlReturn_t)g->fabric_status;
    info->cliqueId = g->fabric_clique;
    info->state = (nvmlGpuFabricState_t)g->fabric_state;
    return leave(NVML_SUCCESS);
}

/* ---- settings: application clocks, power limit, persistence, compute, ECC and MIG modes ---- */

/* With the lock held: write `key = value` into GPU `slot`'s section of the state file (a temp file renamed
 * over it), so every process sees what a setter changed, as every process sees a real GPU's settings. The
 * next call re-reads the file (its identity changed) and finds the same value. */
static nvmlReturn_t persist_locked(unsigned int slot, const char *key, long long value) {
    const char *path = getenv("ROBUSTD_NVML_EMULATOR_STATE");
    if (!path) return NVML_ERROR_UNKNOWN;
    FILE *in = fopen(path, "r");
    if (!in) return NVML_ERROR_UNKNOWN;
    char tmp[4096];
    if (snprintf(tmp, sizeof tmp, "%s.emu-XXXXXX", path) >= (int)sizeof tmp) {
        fclose(in);
        return NVML_ERROR_UNKNOWN;
    }
    int fd = mkstemp(tmp);
    FILE *out = fd < 0 ? NULL : fdopen(fd, "w");
    if (!out) {
        if (fd >= 0) close(fd);
        fclose(in);
        return NVML_ERROR_UNKNOWN;
    }
    char line[2048], replacement[256];
    snprintf(replacement, sizeof replacement, "%s = %lld\n", key, value);
    int section = -1, done = 0;
    size_t klen = strlen(key);
    while (fgets(line, sizeof line, in)) {
        char *s = line;
        while (*s == ' ' || *s == '\t') s++;
        unsigned int idx;
        if (sscanf(s, "[gpu %u]", &idx) == 1) {
            if (section == (int)slot && !done) { fputs(replacement, out); done = 1; }
            section = (int)idx;
        } else if (section == (int)slot && !done && strncmp(s, key, klen) == 0 &&
                   (s[klen] == ' ' || s[klen] == '\t' || s[klen] == '=')) {
            fputs(replacement, out);
            done = 1;
            continue;
        }
        fputs(line, out);
    }
    if (section == (int)slot && !done) fputs(replacement, out);
    fclose(in);
    int bad = fflush(out) != 0 || fsync(fileno(out)) != 0;
    bad |= fclose(out) != 0;
    if (bad || rename(tmp, path) != 0) {
        unlink(tmp);
        return NVML_ERROR_UNKNOWN;
    }
    return NVML_SUCCESS;
}

static nvmlReturn_t get_setting(nvmlDevice_t device, size_t offset, unsigned int *out) {
    ENTER(device, g);
    if (!out) return leave(NVML_ERROR_INVALID_ARGUMENT);
    long long v = *(long long *)((char *)g + offset);
    if (v < 0) return leave(NVML_ERROR_NOT_SUPPORTED);
    *out = (unsigned int)v;
    return leave(NVML_SUCCESS);
}

/* Set one or two settings of a GPU: its set_error first (a daemon without root is NO_PERMISSION), then
 * NOT_SUPPORTED where the getter has nothing, then the value in memory and in the file. */
static nvmlReturn_t set_settings(nvmlDevice_t device, const char *key1, size_t off1, long long v1,
                                 const char *key2, size_t off2, long long v2) {
    ENTER(device, g);
    if (g->set_error) return leave((nvmlReturn_t)g->set_error);
    if (*(long long *)((char *)g + off1) < 0 || (key2 && *(long long *)((char *)g + off2) < 0))
        return leave(NVML_ERROR_NOT_SUPPORTED);
    unsigned int slot = device->slot;
    nvmlReturn_t r = persist_locked(slot, key1, v1);
    if (r == NVML_SUCCESS && key2) r = persist_locked(slot, key2, v2);
    if (r == NVML_SUCCESS) {
        *(long long *)((char *)g + off1) = v1;
        if (key2) *(long long *)((char *)g + off2) = v2;
    }
    return leave(r);
}

#define SETTING(field) offsetof(struct emu_gpu, field)

static size_t app_clock_offset(nvmlClockType_t type, int dflt) {
    if (type == NVML_CLOCK_GRAPHICS || type == NVML_CLOCK_SM)
        return dflt ? SETTING(app_clock_default_graphics) : SETTING(app_clock_graphics);
    if (type == NVML_CLOCK_MEM) return dflt ? SETTING(app_clock_default_mem) : SETTING(app_clock_mem);
    return 0;
}

nvmlReturn_t nvmlDeviceGetApplicationsClock(nvmlDevice_t device, nvmlClockType_t clockType, unsigned int *clockMHz) {
    size_t off = app_clock_offset(clockType, 0);
    return off ? get_setting(device, off, clockMHz) : NVML_ERROR_NOT_SUPPORTED;
}

nvmlReturn_t nvmlDeviceGetDefaultApplicationsClock(nvmlDevice_t device, nvmlClockType_t clockType,
                                                   unsigned int *clockMHz) {
    size_t off = app_clock_offset(clockType, 1);
    return off ? get_setting(device, off, clockMHz) : NVML_ERROR_NOT_SUPPORTED;
}

/* Only the application clock targets: the emulator has no live clocks, nor a customer boost maximum. */
nvmlReturn_t nvmlDeviceGetClock(nvmlDevice_t device, nvmlClockType_t clockType, nvmlClockId_t clockId,
                                unsigned int *clockMHz) {
    if (clockId == NVML_CLOCK_ID_APP_CLOCK_TARGET) return nvmlDeviceGetApplicationsClock(device, clockType, clockMHz);
    if (clockId == NVML_CLOCK_ID_APP_CLOCK_DEFAULT)
        return nvmlDeviceGetDefaultApplicationsClock(device, clockType, clockMHz);
    return NVML_ERROR_NOT_SUPPORTED;
}

nvmlReturn_t nvmlDeviceSetApplicationsClocks(nvmlDevice_t device, unsigned int memClockMHz,
                                             unsigned int graphicsClockMHz) {
    return set_settings(device, "app_clock_mem", SETTING(app_clock_mem), memClockMHz,
                        "app_clock_graphics", SETTING(app_clock_graphics), graphicsClockMHz);
}

nvmlReturn_t nvmlDeviceResetApplicationsClocks(nvmlDevice_t device) {
    long long mem = -1, graphics = -1;
    {
        ENTER(device, g);
        mem = g->app_clock_default_mem;
        graphics = g->app_clock_default_graphics;
        leave(NVML_SUCCESS);
    }
    if (mem < 0 || graphics < 0) return NVML_ERROR_NOT_SUPPORTED;
    return nvmlDeviceSetApplicationsClocks(device, (unsigned int)mem, (unsigned int)graphics);
}

/* The emulator has one power limit: the enforced limit is the management limit. */
nvmlReturn_t nvmlDeviceGetPowerManagementLimit(nvmlDevice_t device, unsigned int *limit) {
    return get_setting(device, SETTING(power_limit_mw), limit);
}

nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(nvmlDevice_t device, unsigned int *limit) {
    return get_setting(device, SETTING(power_limit_mw), limit);
}

nvmlReturn_t nvmlDeviceSetPowerManagementLimit(nvmlDevice_t device, unsigned int limit) {
    return set_settings(device, "power_limit_mw", SETTING(power_limit_mw), limit, NULL, 0, 0);
}

nvmlReturn_t nvmlDeviceGetPersistenceMode(nvmlDevice_t device, nvmlEnableState_t *mode) {
    unsigned int v = 0;
    nvmlReturn_t r = get_setting(device, SETTING(persistence_mode), &v);
    if (r == NVML_SUCCESS && mode) *mode = (nvmlEnableState_t)v;
    return mode ? r : NVML_ERROR_INVALID_ARGUMENT;
}

nvmlReturn_t nvmlDeviceSetPersistenceMode(nvmlDevice_t device, nvmlEnableState_t mode) {
    if (mode != NVML_FEATURE_DISABLED && mode != NVML_FEATURE_ENABLED) return NVML_ERROR_INVALID_ARGUMENT;
    return set_settings(device, "persistence_mode", SETTING(persistence_mode), mode, NULL, 0, 0);
}

nvmlReturn_t nvmlDeviceGetComputeMode(nvmlDevice_t device, nvmlComputeMode_t *mode) {
    unsigned int v = 0;
    nvmlReturn_t r = get_setting(device, SETTING(compute_mode), &v);
    if (r == NVML_SUCCESS && mode) *mode = (nvmlComputeMode_t)v;
    return mode ? r : NVML_ERROR_INVALID_ARGUMENT;
}

nvmlReturn_t nvmlDeviceSetComputeMode(nvmlDevice_t device, nvmlComputeMode_t mode) {
    if ((unsigned int)mode >= NVML_COMPUTEMODE_COUNT) return NVML_ERROR_INVALID_ARGUMENT;
    return set_settings(device, "compute_mode", SETTING(compute_mode), mode, NULL, 0, 0);
}

/* ECC and MIG modes: read only here (a change takes effect at the next GPU reset). */
static nvmlReturn_t get_pair(nvmlDevice_t device, size_t off_current, size_t off_pending, unsigned int *current,
                             unsigned int *pending) {
    if (!current || !pending) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t r = get_setting(device, off_current, current);
    return r == NVML_SUCCESS ? get_setting(device, off_pending, pending) : r;
}

nvmlReturn_t nvmlDeviceGetEccMode(nvmlDevice_t device, nvmlEnableState_t *current, nvmlEnableState_t *pending) {
    unsigned int c = 0, p = 0;
    nvmlReturn_t r = get_pair(device, SETTING(ecc_mode), SETTING(ecc_pending), &c, &p);
    if (r == NVML_SUCCESS && current && pending) {
        *current = (nvmlEnableState_t)c;
        *pending = (nvmlEnableState_t)p;
    }
    return current && pending ? r : NVML_ERROR_INVALID_ARGUMENT;
}

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *currentMode, unsigned int *pendingMode) {
    return get_pair(device, SETTING(mig_mode), SETTING(mig_pending), currentMode, pendingMode);
}

/* ---- field values ----------------------------------------------------------------------- */

/* The recovery action (what a GpuRecoveryAction event asks the reader to look up) and each NVLink's
 * state (NVML_FI_DEV_NVLINK_GET_STATE, link in scopeId: INVALID_ARGUMENT past the last link,
 * NOT_SUPPORTED without NVLink); every other field answers NOT_SUPPORTED in its own entry, as the
 * driver does for fields a GPU lacks. */
nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t device, int valuesCount, nvmlFieldValue_t *values) {
    ENTER(device, g);
    if (valuesCount < 0 || (valuesCount && !values)) return leave(NVML_ERROR_INVALID_ARGUMENT);
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    for (int i = 0; i < valuesCount; i++) {
        nvmlFieldValue_t *v = &values[i];
        v->timestamp = (long long)now.tv_sec * 1000000LL + now.tv_nsec / 1000;
        v->latencyUsec = 0;
        if (v->fieldId == NVML_FI_DEV_GET_GPU_RECOVERY_ACTION) {
            v->valueType = NVML_VALUE_TYPE_UNSIGNED_INT;
            v->value.uiVal = g->recovery_action;
            v->nvmlReturn = NVML_SUCCESS;
        } else if (v->fieldId == NVML_FI_DEV_NVLINK_GET_STATE) {
            if (g->nvlink_count == 0) {
                v->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
            } else if (v->scopeId >= g->nvlink_count) {
                v->nvmlReturn = NVML_ERROR_INVALID_ARGUMENT;
            } else {
                v->valueType = NVML_VALUE_TYPE_UNSIGNED_INT;
                v->value.uiVal = g->nvlink_down[v->scopeId] ? NVML_NVLINK_STATE_INACTIVE : NVML_NVLINK_STATE_ACTIVE;
                v->nvmlReturn = NVML_SUCCESS;
            }
        } else {
            v->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
        }
    }
    return leave(NVML_SUCCESS);
}

/* ---- events ----------------------------------------------------------------------------- */

static long long realtime_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static long long monotonic_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* With the lock held: `set` if it is one of ours and alive, else NULL. */
static struct nvmlEventSet_st *live_set(nvmlEventSet_t set) {
    uintptr_t at = (uintptr_t)set, first = (uintptr_t)&sets[0];
    if (at < first || at >= first + sizeof sets || (at - first) % sizeof sets[0]) return NULL;
    return set->used ? set : NULL;
}

nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set) {
    if (!set) return NVML_ERROR_INVALID_ARGUMENT;
    pthread_mutex_lock(&lock);
    if (init_count <= 0) return leave(NVML_ERROR_UNINITIALIZED);
    refresh_locked(); /* events already in the file are history for the new set */
    for (int i = 0; i < EMU_MAX_SETS; i++) {
        if (!sets[i].used) {
            memset(&sets[i], 0, sizeof sets[i]);
            sets[i].used = 1;
            *set = &sets[i];
            return leave(NVML_SUCCESS);
        }
    }
    return leave(NVML_ERROR_UNKNOWN);
}

nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) {
    pthread_mutex_lock(&lock);
    if (init_count <= 0) return leave(NVML_ERROR_UNINITIALIZED);
    struct nvmlEventSet_st *s = live_set(set);
    if (!s) return leave(NVML_ERROR_INVALID_ARGUMENT);
    s->used = 0;
    return leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device, unsigned long long *eventTypes) {
    ENTER(device, g);
    if (!eventTypes) return leave(NVML_ERROR_INVALID_ARGUMENT);
    *eventTypes = g->event_types & EMU_EVENT_TYPES_ALL;
    return leave(NVML_SUCCESS);
}

/* Types the GPU does not support: NOT_SUPPORTED and none registered (the set stays usable). */
nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes, nvmlEventSet_t set) {
    ENTER(device, g);
    struct nvmlEventSet_st *s = live_set(set);
    if (!s || (eventTypes & ~EMU_EVENT_TYPES_ALL)) return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (!eventTypes || (eventTypes & ~g->event_types)) return leave(NVML_ERROR_NOT_SUPPORTED);
    unsigned int slot = (unsigned int)(g - state.gpus);
    long long now = realtime_ns();
    for (int b = 0; b < EMU_EVENT_BITS; b++)
        if ((eventTypes & (1ULL << b)) && !s->registered_at[slot][b]) s->registered_at[slot][b] = now;
    return leave(NVML_SUCCESS);
}

/* With the lock held: whether a GPU registered in `s` has the "hang" fault (then the wait blocks). */
static int set_hung_locked(struct nvmlEventSet_st *s) {
    for (unsigned int i = 0; i < state.ngpus; i++) {
        if (!state.gpus[i].hang) continue;
        for (int b = 0; b < EMU_EVENT_BITS; b++)
            if (s->registered_at[i][b]) return 1;
    }
    return 0;
}

/* A descriptor that turns readable when the state file is replaced or rewritten (inotify on its
 * directory: the simulator renames a new file over the old one), or -1 where inotify is not there.
 * A waiter sleeps on it instead of polling the file, so an event reaches it as soon as `robustctl sim`
 * writes it, and an idle waiter costs nothing. */
static int state_watch_open(void) {
    const char *path = getenv("ROBUSTD_NVML_EMULATOR_STATE");
    if (!path) return -1;
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", path);
    char *slash = strrchr(dir, '/');
    if (!slash) snprintf(dir, sizeof dir, ".");
    else if (slash == dir) slash[1] = '\0';
    else *slash = '\0';
    int fd = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
    if (fd < 0) return -1;
    if (inotify_add_watch(fd, dir, IN_MOVED_TO | IN_CLOSE_WRITE | IN_CREATE) < 0) {
        close(fd);
        return -1;
    }
    return fd;
}

/* Sleep at most `ns`, waking early when the state file changes. */
static void state_watch_wait(int fd, long long ns) {
    if (ns <= 0) return;
    if (fd < 0) {
        struct timespec ts = {ns / 1000000000LL, ns % 1000000000LL};
        nanosleep(&ts, NULL);
        return;
    }
    struct pollfd p = {fd, POLLIN, 0};
    if (poll(&p, 1, (int)((ns + 999999) / 1000000)) > 0) {
        char buf[4096];
        while (read(fd, buf, sizeof buf) > 0) {
        }
    }
}

static nvmlReturn_t wait_events(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms, int watch) {
    long long deadline = monotonic_ns() + (long long)timeoutms * 1000000LL;
    for (;;) {
        pthread_mutex_lock(&lock);
        if (init_count <= 0) return leave(NVML_ERROR_UNINITIALIZED);
        struct nvmlEventSet_st *s = live_set(set);
        if (!s) return leave(NVML_ERROR_INVALID_ARGUMENT);
        refresh_locked();
        int hung = set_hung_locked(s);
        if (!hung && s->count) {
            struct emu_queued e = s->queue[s->head];
            s->head = (s->head + 1) % EMU_SET_QUEUE;
            s->count--;
            memset(data, 0, sizeof *data);
            data->device = &handles[e.slot];
            data->eventType = e.type;
            data->eventData = e.type == nvmlEventTypeXidCriticalError ? e.data : 0;
            data->gpuInstanceId = 0xFFFFFFFFu;
            data->computeInstanceId = 0xFFFFFFFFu;
            return leave(NVML_SUCCESS);
        }
        pthread_mutex_unlock(&lock);
        long long left = deadline - monotonic_ns();
        if (!hung && left <= 0) return NVML_ERROR_TIMEOUT;
        /* With an inotify watch, sleep until the file changes or the wait ends (a driver sleeps too: no
         * wake-ups while nothing happens); without one, look at the file every EMU_EVENT_POLL_NS. */
        long long nap = watch >= 0 || left < EMU_EVENT_POLL_NS ? left : EMU_EVENT_POLL_NS;
        state_watch_wait(watch, hung ? EMU_HANG_POLL_NS : nap);
    }
}

nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms) {
    if (!data) return NVML_ERROR_INVALID_ARGUMENT;
    int watch = state_watch_open(); /* before the first look at the file: no change slips between */
    nvmlReturn_t r = wait_events(set, data, timeoutms, watch);
    if (watch >= 0) close(watch);
    return r;
}

nvmlReturn_t nvmlEventSetWait(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms) {
    return nvmlEventSetWait_v2(set, data, timeoutms);
}
