"""The `flashrt` console script."""
import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="flashrt", description="FlashRT ROS: fast robot policy inference")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="what hardware, kernels and ROS pieces are available")
    args = parser.parse_args(argv)
    if args.command == "doctor":
        from flashrt_ros.doctor import doctor

        return doctor()
    return 2


if __name__ == "__main__":
    sys.exit(main())
