"""
Chat with a trained model in the terminal. Replies stream as they are generated.

    python -m scripts.chat_cli                                   # interactive, the sft model
    python -m scripts.chat_cli -i mid -g d20 -s 1000             # a given stage / model tag / step
    python -m scripts.chat_cli -p "Why is the sky blue?"         # one reply, then exit (for scripts)

Interactive commands: `clear` starts a new conversation, `quit` (or `exit`, Ctrl-D) leaves; Ctrl-C stops a reply.
"""

import sys
from contextlib import nullcontext

import torch

from nanochat.common import autodetect_device_type, compute_init, device_type_flag
from nanochat.checkpoint_manager import checkpoint_flags
from nanochat.configurator import Flag, Flags
from nanochat.attention import attn_flag
from nanochat.engine import Engine, TextStreamer, decode_compile_flag
from nanochat.usage import run_main


FLAGS = Flags(
    checkpoint_flags("sft"),
    Flag("prompt", "", "answer this one prompt and exit (for scripts); empty = interactive", short="p"),
    Flag("temperature", 0.6, "sampling temperature (0 = greedy)", short="t", min=0.0),
    Flag("top_k", 50, "sample among the k most likely tokens (0 = all)", short="k", min=0),
    Flag("max_tokens", 256, "max tokens per reply", short="m", min=1),
    Flag("seed", 42, "sampling seed (turn i uses seed + i)"),
    device_type_flag(),
    Flag("dtype", "bfloat16", "autocast dtype on CUDA", choices=["bfloat16", "float32"]),
    attn_flag(),
    decode_compile_flag(),
    description=__doc__,
)


def build_arg_parser():
    return FLAGS


class Chat:
    """The conversation as token ids in nanochat's chat format, and one streamed reply per user turn."""

    def __init__(self, engine, autocast_ctx, temperature, top_k, max_tokens, seed):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.autocast_ctx = autocast_ctx
        self.gen_kwargs = dict(temperature=temperature, top_k=top_k or None, max_tokens=max_tokens)
        self.seed = seed
        self.assistant_end = self.tokenizer.encode_special("<|assistant_end|>")
        self.stop_ids = {engine.assistant_end, engine.bos}
        self.turn = 0
        self.clear()

    def clear(self):
        self.tokens = [self.tokenizer.get_bos_token_id()]

    def reply(self, user_text, out):
        """Stream the assistant's answer to `out`; the turn is added to the conversation. Returns the reply text."""
        # The new user turn is rendered by the tokenizer, like every chat prompt (without its <|bos|>: the conversation
        # has it). Earlier replies stay as the ids that were sampled: their text might encode to other ids.
        turn = self.tokenizer.render_for_completion({"messages": [{"role": "user", "content": user_text}]})
        prompt = self.tokens + turn[1:]
        room = self.engine.max_positions() - len(prompt)
        if room < 1:
            raise ValueError(f"the conversation is {len(prompt)} tokens, more than the model can address; type `clear` to start over")
        streamer, reply_tokens, pieces = TextStreamer(self.tokenizer), [], []
        try:
            with self.autocast_ctx():
                for token_column, _ in self.engine.generate(prompt, num_samples=1, seed=self.seed + self.turn, **self.gen_kwargs):
                    token = token_column[0]
                    if token in self.stop_ids:
                        break
                    reply_tokens.append(token)
                    piece = streamer.push(token)
                    if piece:
                        pieces.append(piece)
                        out.write(piece)
                        out.flush()
        except KeyboardInterrupt:  # Ctrl-C ends this reply, not the session
            out.write(" [stopped]")
        finally:
            rest = streamer.flush()
            if rest:
                pieces.append(rest)
                out.write(rest)
            out.write("\n")
            out.flush()
            # the turn is closed with <|assistant_end|> even when cut short, so the next prompt is well formed
            self.tokens = prompt + reply_tokens + [self.assistant_end]
            self.turn += 1
        return "".join(pieces)


def main(argv=None):
    parser = build_arg_parser()
    args = parser.parse_args(argv)

    from nanochat.checkpoint_manager import load_model, resolve_checkpoint

    model_tag, step = resolve_checkpoint(args.source, args.model_tag, args.step)  # start-up check: it exists
    device_type = args.device_type or autodetect_device_type()
    _, _, _, _, device = compute_init(device_type)
    model, tokenizer, _ = load_model(args.source, device, phase="eval", model_tag=model_tag, step=step,
                                  weights_dtype=args.weights_dtype)
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    if device_type == "cuda" and dtype != torch.float32:
        autocast_ctx = lambda: torch.amp.autocast(device_type="cuda", dtype=dtype)  # noqa: E731
    else:
        autocast_ctx = nullcontext
    model.set_attn(args.attn)
    chat = Chat(Engine(model, tokenizer, args.decode_compile), autocast_ctx, args.temperature, args.top_k, args.max_tokens, args.seed)

    if args.prompt:
        chat.reply(args.prompt, sys.stdout)
        return

    print("nanochat interactive mode: type a message; `clear` starts over, `quit` leaves.")
    while True:
        try:
            user_text = input("\nUser: ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            break
        if user_text.lower() in ("quit", "exit"):
            break
        if user_text.lower() == "clear":
            chat.clear()
            print("Conversation cleared.")
            continue
        if not user_text:
            continue
        sys.stdout.write("\nAssistant: ")
        sys.stdout.flush()
        try:
            chat.reply(user_text, sys.stdout)
        except ValueError as e:
            print(f"\n{e}")


if __name__ == "__main__":
    run_main(main)
