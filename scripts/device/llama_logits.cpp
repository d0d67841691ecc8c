// Writes llama.cpp's logits for a token sequence, every position, as raw float32
// [T, vocab] (little endian), computed in one batch ("prefill") or one token per
// llama_decode call ("decode"). Built on the device machine against the libllama of the
// llama-cpp-python sources; used by scripts/device/ds4_llamacpp.sh as the peer engine.
//
// usage: llama_logits MODEL.gguf 5,17,2,... prefill|decode OUT.f32 [N_UBATCH]
// (prefill submits every token in one llama_decode; llama.cpp splits it into ubatches
// of N_UBATCH, default: all of them)
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "llama.h"

int main(int argc, char ** argv) {
    if (argc != 5 && argc != 6) {
        fprintf(stderr, "usage: %s MODEL.gguf TOKENS prefill|decode OUT.f32 [N_UBATCH]\n", argv[0]);
        return 2;
    }
    std::vector<llama_token> toks;
    for (char * s = strtok(argv[2], ","); s; s = strtok(nullptr, ",")) toks.push_back(atoi(s));
    const bool batched = std::string(argv[3]) == "prefill";
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "cannot load %s\n", argv[1]); return 1; }
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = toks.size() + 16;
    cp.n_batch = toks.size();
    cp.n_ubatch = argc == 6 ? atoi(argv[5]) : toks.size();
    cp.n_threads = cp.n_threads_batch = 8;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) { fprintf(stderr, "cannot create a context\n"); return 1; }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    std::vector<float> out;
    const int step = batched ? (int) toks.size() : 1;
    llama_batch b = llama_batch_init(step, 0, 1);
    for (size_t p0 = 0; p0 < toks.size(); p0 += step) {
        b.n_tokens = step;
        for (int i = 0; i < step; i++) {
            b.token[i] = toks[p0 + i];
            b.pos[i] = p0 + i;
            b.n_seq_id[i] = 1;
            b.seq_id[i][0] = 0;
            b.logits[i] = 1;
        }
        if (llama_decode(ctx, b) != 0) { fprintf(stderr, "llama_decode failed at %zu\n", p0); return 1; }
        for (int i = 0; i < step; i++) {
            const float * l = llama_get_logits_ith(ctx, i);
            out.insert(out.end(), l, l + n_vocab);
        }
    }
    FILE * f = fopen(argv[4], "wb");
    fwrite(out.data(), sizeof(float), out.size(), f);
    fclose(f);
    fprintf(stderr, "wrote %zu x %d logits\n", toks.size(), n_vocab);
    llama_batch_free(b);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
