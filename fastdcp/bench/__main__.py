import sys

if __name__ == "__main__":
    if sys.argv[1:2] == ["gpu-acceptance"]:
        # Imports no fastdcp module: on a bare tree it builds the extension first (acceptance.py).
        from .acceptance import main as acceptance_main

        sys.exit(acceptance_main(sys.argv[2:]))
    from .runner import main

    sys.exit(main())
