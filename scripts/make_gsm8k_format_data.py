"""Build a small local dataset in GSM8K's format: `python scripts/make_gsm8k_format_data.py [--output-dir DIR]`.

Writes train/test splits of arithmetic word problems as parquet (columns `question`, `answer` ending in
`#### N`) and as `messages`-style JSONL, for `data.train_file` / `data.eval_file`.
"""

from __future__ import annotations

import argparse

from roll.datasets.gsm8k_format import write_gsm8k_format


def main() -> None:
    """Parse the arguments, write the files and list them."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", default="data/gsm8k_format", help="where the files go")
    parser.add_argument("--max-operand", type=int, default=19, help="operands range over 0..max-operand")
    parser.add_argument("--operations", default="+-", help="some of + - *")
    parser.add_argument("--seed", type=int, default=0, help="the seed of the train/test split")
    args = parser.parse_args()
    paths = write_gsm8k_format(args.output_dir, args.max_operand, args.operations, args.seed)
    for path in paths.values():
        print(path)


if __name__ == "__main__":
    main()
