from specpilot.services.controller.main import main

main()
