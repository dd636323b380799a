"""`kmesh generate`: complete one prompt with the reference engine."""

import argparse
import json
from dataclasses import asdict

from kmesh.cli.common import Commands, add_model_option, add_store_option, check_store


def _generate(args: argparse.Namespace) -> None:
    from kmesh.engine.llm import LLM, check_prompt_text
    from kmesh.engine.request import SamplingParams

    check_prompt_text(args.prompt)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
    )
    check_store(args.store)
    llm = LLM(args.model, store=args.store, max_model_len=args.max_model_len)
    [completion] = llm.generate([args.prompt], params, chat=args.chat, tenant_salt=args.tenant_salt)
    out = completion.output
    if args.json:
        print(
            json.dumps(
                {
                    "text": completion.text,
                    "token_ids": list(out.output_ids),
                    "prompt_token_ids": list(out.prompt_ids),
                    "finish_reason": out.finish_reason,
                    "stats": asdict(out.stats),
                }
            )
        )
    else:
        print(completion.text)


def register(commands: Commands) -> None:
    gen = commands.add_parser("generate", help="complete one prompt with the reference engine")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--tenant-salt", default=None, help="keep this request's state apart")
    add_store_option(gen)
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    add_model_option(gen, context=True)
    gen.set_defaults(func=_generate)
