// Package middleware is millrace's consumer side.
package middleware
