"""
Our checkpoints out: to a Hugging Face GPT-2 folder (+ a PEFT adapter) or plain safetensors.

    python export.py out/ckpt-0000100 --to hf gpt2-shakespeare      # a LoRA run: + adapter/
    python export.py out/ckpt-0000100 --to hf gpt2-merged --merge --dtype bf16
    python export.py out/ckpt-0000100 --to safetensors weights.safetensors

The checkpoint is rebuilt as it trained (LoRA, a quantized base), its quantized weights
dequantized; the adapter is either merged in (W0 + B·A·alpha/r) or written beside the base in
PEFT's format. Every check comes before the first byte is written (machinery/exporter.py).
"""
import sys

from configurator import OneLineParser, UserError
from machinery.exporter import export
from machinery.run import run_main
from precision import DTYPES


def main(argv=None):
    p = OneLineParser(prog="export.py", description="Export a checkpoint's weights: a "
                      "Hugging Face GPT-2 folder, or plain safetensors.")  # one-line errors
    p.add_argument("ckpt", metavar="CKPT", help="a checkpoint folder (either format)")
    p.add_argument("--to", required=True, choices=["hf", "safetensors"],
                   help="hf: config.json + model.safetensors (+ adapter/ for LoRA); "
                        "safetensors: the weights as model.py names them")
    p.add_argument("out", metavar="OUT", help="the folder (hf) or .safetensors file to write")
    p.add_argument("--dtype", choices=list(DTYPES), help="--to hf: the weights' dtype (fp32)")
    p.add_argument("--merge", action="store_true",
                   help="fold a LoRA adapter into the weights (a quantized base dequantized)")

    def body():
        args = p.parse_args(argv)
        try:
            lines = export(args.ckpt, args.to, args.out, args.dtype, args.merge)
        except OSError as e:  # a full disk, a vanished folder: the temporary files are gone
            raise UserError(f"cannot write {args.out}: {e.strerror or e}")
        print("\n".join(lines))
    return run_main(body, "export.py")


if __name__ == "__main__":
    sys.exit(main())
