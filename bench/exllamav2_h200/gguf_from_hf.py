"""Step 4a: llama.cpp's convert_hf_to_gguf.py on the synthetic model, told its tokenizer is Qwen2's.

llama.cpp names a BPE tokenizer's pre-tokenizer by hashing what it makes of a test text and
refuses hashes it does not know. build_model.py's tokenizer uses Qwen2's pre-tokenizer (same
regex, ByteLevel) with a vocabulary of its own, so "qwen2" is the truthful answer; this
wrapper gives it and runs the converter unchanged otherwise.

Usage: python gguf_from_hf.py LLAMA_CPP_SRC MODEL_DIR OUT.gguf
"""

import sys

src, model_dir, outfile = sys.argv[1:4]
sys.path.insert(0, src)
sys.argv = ["convert_hf_to_gguf.py", model_dir, "--outtype", "f16", "--outfile", outfile]
import convert_hf_to_gguf as convert  # noqa: E402 - after the path is set

try:  # newer trees keep the model classes in a conversion/ package
    from conversion.base import TextModel  # noqa: E402
except ImportError:  # older ones in convert_hf_to_gguf.py itself
    TextModel = convert.TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
convert.main()
