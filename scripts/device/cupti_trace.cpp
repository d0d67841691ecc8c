// Kernel timeline of a CUDA process as the GPU ran it, graph replays included: a CUPTI
// activity injection library (the driver loads it when CUDA_INJECTION64_PATH names it).
// Each kernel's start / end (ns), stream, graph id and the correlation id of the API call
// that launched it (one graph replay = one id) are written, tab-separated, to the file
// CUPTI_TRACE_OUT at exit. Concurrent-kernel records: kernels are not serialised.
// Built by scripts/device/ds4_timeline.sh with -DKREC=<newest CUpti_ActivityKernelN
// in the toolkit's cupti_activity.h> (the record's version differs between toolkits).
#include <cupti.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

namespace {
struct Row {
    unsigned long long start, end;
    unsigned int stream, graph, corr;
    std::string name;
};
std::mutex mu;
std::vector<Row> rows;
constexpr size_t kBuf = 8 << 20;

void CUPTIAPI requested(uint8_t** buf, size_t* size, size_t* max_records) {
    *buf = static_cast<uint8_t*>(aligned_alloc(8, kBuf));
    *size = *buf ? kBuf : 0;  // 0: CUPTI drops records (counted at exit)
    *max_records = 0;
}

void CUPTIAPI completed(CUcontext, uint32_t, uint8_t* buf, size_t, size_t valid) {
    CUpti_Activity* rec = nullptr;
    std::lock_guard<std::mutex> g(mu);
    while (cuptiActivityGetNextRecord(buf, valid, &rec) == CUPTI_SUCCESS) {
        if (rec->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) continue;
        const KREC* k = reinterpret_cast<const KREC*>(rec);
        rows.push_back({k->start, k->end, k->streamId, k->graphId, k->correlationId,
                        k->name ? k->name : "?"});
    }
    free(buf);
}

void flush() {
    cuptiActivityFlushAll(1);
    const char* path = getenv("CUPTI_TRACE_OUT");
    FILE* f = fopen(path ? path : "cupti_trace.tsv", "w");
    if (!f) {
        perror("cupti_trace: open CUPTI_TRACE_OUT");
        return;
    }
    std::lock_guard<std::mutex> g(mu);
    for (const Row& r : rows)
        fprintf(f, "%llu\t%llu\t%u\t%u\t%u\t%s\n", r.start, r.end, r.stream, r.graph, r.corr, r.name.c_str());
    fclose(f);
    size_t dropped = 0;
    cuptiActivityGetNumDroppedRecords(nullptr, 0, &dropped);
    fprintf(stderr, "cupti_trace: %zu kernels written, %zu records dropped\n", rows.size(), dropped);
}
}  // namespace

extern "C" int InitializeInjection(void) {
    if (cuptiActivityRegisterCallbacks(requested, completed) != CUPTI_SUCCESS ||
        cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS) {
        fprintf(stderr, "cupti_trace: CUPTI activity setup failed\n");
        return 0;
    }
    atexit(flush);
    return 1;
}
