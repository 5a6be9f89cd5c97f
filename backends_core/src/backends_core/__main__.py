from backends_core.cli import main

raise SystemExit(main())
