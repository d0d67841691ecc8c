#!/usr/bin/env python3
"""Runs llama.cpp's own convert_hf_to_gguf.py (from the llama-cpp-python 0.3.36 sources)
on a checkpoint, with one change made from outside: its BPE pre-tokenizer check, which
only accepts tokenizers whose hash it lists, answers "default" for our test checkpoint's
toy byte-level tokenizer. The tensor and metadata conversion is untouched.

Usage: llamacpp_convert.py LLAMA_CPP_DIR CHECKPOINT_DIR OUT.gguf [CONVERTER ARGS...]
(e.g. --mtp: the checkpoint's next-token-prediction block as a drafter file)
"""
import runpy
import sys
from pathlib import Path

llama_dir, ckpt, out = map(Path, sys.argv[1:4])
sys.path.insert(0, str(llama_dir / "gguf-py"))
sys.path.insert(0, str(llama_dir))
import conversion.base as base  # noqa: E402

base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
sys.argv = ["convert_hf_to_gguf.py", str(ckpt), "--outfile", str(out), "--outtype", "f32",
            *sys.argv[4:]]
runpy.run_path(str(llama_dir / "convert_hf_to_gguf.py"), run_name="__main__")
