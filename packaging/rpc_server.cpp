// tandem-rpc-server: llama.cpp's RPC server (ggml_backend_rpc_start_server) for this
// machine's CPU, reporting the memory it really offers.
//
// Why not llama.cpp's own rpc-server tool: llama-cpp-python's build does not build it,
// and its CPU device reports all physical RAM as free, so a client splitting a model by
// the servers' free memory would overfill a busy machine. Here the CPU device is wrapped
// so that the memory it reports is MemAvailable (Linux), capped by --mem when given.
// Everything else (protocol, tensor cache, compute) is llama.cpp's, from the same build
// as the Python package, so client and server always speak the same protocol version.
//
// Built by packaging/bootstrap.sh against the wheel's libggml; run it through
// `tandem rpc-server`, which binds loopback by default and warns for any other host.
#include "ggml-backend-impl.h"
#include "ggml-backend.h"
#include "ggml-rpc.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

static ggml_backend_dev_t g_cpu = nullptr;     // the real CPU device
static size_t g_cap = 0;                       // --mem in bytes, 0 = no cap
static ggml_backend_device g_offered;          // the CPU device, reporting offered memory

// MemAvailable from /proc/meminfo in bytes, 0 where there is none.
static size_t mem_available() {
    std::ifstream meminfo("/proc/meminfo");
    std::string key;
    size_t kib = 0;
    while (meminfo >> key >> kib) {
        if (key == "MemAvailable:") {
            return kib * 1024;
        }
        meminfo.ignore(256, '\n');
    }
    return 0;
}

static void offered_memory(size_t * free, size_t * total) {
    g_cpu->iface.get_memory(g_cpu, free, total);
    const size_t avail = mem_available();
    if (avail > 0) {
        *free = std::min(*free, avail);
    }
    if (g_cap > 0) {
        *free = std::min(*free, g_cap);
        *total = std::min(*total, g_cap);
    }
}

static void offered_get_memory(ggml_backend_dev_t, size_t * free, size_t * total) {
    offered_memory(free, total);
}

static void offered_get_props(ggml_backend_dev_t, ggml_backend_dev_props * props) {
    g_cpu->iface.get_props(g_cpu, props);
    offered_memory(&props->memory_free, &props->memory_total);
}

// The server asks the backend for its device when a client asks for memory, so the
// backend created for the wrapped device must point back at it.
static ggml_backend_t offered_init_backend(ggml_backend_dev_t dev, const char * params) {
    ggml_backend_t backend = g_cpu->iface.init_backend(g_cpu, params);
    if (backend != nullptr) {
        backend->device = dev;
    }
    return backend;
}

static int usage(const char * argv0) {
    fprintf(stderr,
            "usage: %s [--host HOST] [--port PORT] [--threads N] [--mem MB] [--cache]\n"
            "  --host     address to bind (default 127.0.0.1; the server has no authentication)\n"
            "  --port     TCP port (default 50052)\n"
            "  --threads  CPU threads for computing (default 1)\n"
            "  --mem      memory to offer clients in MiB (default: what the machine has available)\n"
            "  --cache    keep received tensors in llama.cpp's local file cache\n",
            argv0);
    return 2;
}

int main(int argc, char ** argv) {
    std::string host = "127.0.0.1";
    int port = 50052;
    int threads = 1;
    bool cache = false;
    for (int i = 1; i < argc; i++) {
        const std::string arg = argv[i];
        const bool has_value = i + 1 < argc;
        if (arg == "--host" && has_value) {
            host = argv[++i];
        } else if (arg == "--port" && has_value) {
            port = std::atoi(argv[++i]);
        } else if (arg == "--threads" && has_value) {
            threads = std::atoi(argv[++i]);
        } else if (arg == "--mem" && has_value) {
            g_cap = static_cast<size_t>(std::strtoull(argv[++i], nullptr, 10)) * 1024 * 1024;
        } else if (arg == "--cache") {
            cache = true;
        } else {
            return usage(argv[0]);
        }
    }
    if (port <= 0 || port > 65535 || threads <= 0) {
        return usage(argv[0]);
    }
    ggml_backend_load_all();
    g_cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    ggml_backend_reg_t rpc = ggml_backend_reg_by_name("RPC");
    if (g_cpu == nullptr || rpc == nullptr) {
        fprintf(stderr, "error: this llama.cpp build has no %s backend\n", g_cpu ? "RPC" : "CPU");
        return 1;
    }
    auto start = reinterpret_cast<decltype(ggml_backend_rpc_start_server) *>(
        ggml_backend_reg_get_proc_address(rpc, "ggml_backend_rpc_start_server"));
    if (start == nullptr) {
        fprintf(stderr, "error: the RPC backend has no server entry point\n");
        return 1;
    }
    g_offered = *g_cpu;
    g_offered.iface.get_memory = offered_get_memory;
    g_offered.iface.get_props = offered_get_props;
    g_offered.iface.init_backend = offered_init_backend;
    ggml_backend_dev_t devices[] = {&g_offered};

    std::string cache_dir;
    if (cache) {
        const char * xdg = std::getenv("XDG_CACHE_HOME");
        const char * home = std::getenv("HOME");
        cache_dir = xdg ? std::string(xdg) : std::string(home ? home : ".") + "/.cache";
        cache_dir += "/tandem/rpc-tensors";
        std::error_code err;
        std::filesystem::create_directories(cache_dir, err);
        if (err) {
            fprintf(stderr, "error: cannot create %s\n", cache_dir.c_str());
            return 1;
        }
    }
    const std::string endpoint = host + ":" + std::to_string(port);
    setvbuf(stdout, nullptr, _IOLBF, 0);
    start(endpoint.c_str(), cache ? cache_dir.c_str() : nullptr, threads, 1, devices);
    return 1;  // the server returns only when it could not listen
}
